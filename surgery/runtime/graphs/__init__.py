"""surgery's own CUDA graphs: one graph per region path and call signature, captured and
replayed without entering dynamo. Knows tensors and modules, never a manifest: it imports
nothing from the rest of surgery (tests/test_layers.py checks it). The contract is in
surgery.runtime.graphs.replay."""
