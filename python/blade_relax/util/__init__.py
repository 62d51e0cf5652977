"""Helpers with no knowledge of Relax, shared by every layer above them.

* :mod:`.cliargs`: what the command lines share (one-line errors, output paths and memory
  checked before any long step);
* :mod:`.collection`: CPython's cyclic garbage collector paused around a pass or a measured
  call;
* :mod:`.figures`: matplotlib figures saved as small PNGs;
* :mod:`.quiet`: TVM's native warnings and the Hugging Face stack's notes filtered from stderr.

They import nothing of blade_relax and nothing heavy: the command lines use them to answer
``--help`` and bad input before TVM is imported. Import the modules themselves; this package
imports none of them.
"""
