"""Choosing compile regions: the model view, region finding by names and structure, and by
evidence from a watched run (`surgery plan --input`). Builds on surgery.formats and, for the
watched run's call signatures, surgery.runtime.signatures."""
