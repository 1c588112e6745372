"""The speculative decoder core, below everything that decodes (eval, regenerate, training-time
evaluation): the pure accept/resample rule (``sampling``), the drafter protocol and the one
draft loop drafters share (``protocol``), the chain decode loop (``chain``) and its stats
(``stats``). It takes plain values, never a recipe section, and imports only ``target``,
``errors``, ``files`` and ``devices``."""
