"""The files surgery reads and writes, and the data they carry. Imports no other layer.

Checkpoints (safetensors headers, pickles through `torch.load(weights_only=True)`, shards,
save_pretrained folders) are read as untrusted input; the streaming safetensors writer and every
other output go through the atomic writer; the manifest (its model, TOML and JSON Schema), the
canonical keys and the fingerprint that binds a manifest to its model live here too. Nothing in
this package imports torch at module level: `surgery verify` of a safetensors file never does.
"""
