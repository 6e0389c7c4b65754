"""`python -m surgery.examples OUT.pt`: save the hand-compiled example checkpoint."""

from surgery.examples.demo import save_main

save_main()
