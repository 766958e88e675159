"""KV block movement on byte-backed paged pools (torch; CPU in CI, CUDA side streams on a GPU).

``layout`` (KvLayout, slot checks, run coalescing; no torch), ``pool`` (BlockPool, host pools,
SlotAllocator), ``ops`` (gather / scatter / async copy / broadcast), ``ref`` (the loop
reference), ``checksum``, ``triton_ops`` (optional), ``bench`` + ``cli`` (``evolving bench kv``).
Importing this package does not import torch; the modules that need it do. See docs/kernels.md.
"""
