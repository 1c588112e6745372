"""The speculative decoder core, below everything that decodes (eval, regenerate, training-time
evaluation): the pure accept/resample rule (``sampling``), the drafter protocol, its optional
abilities and the one draft loop drafters share (``protocol``), the round skeleton of both decoders
and the chain round (``rounds``), trees and the tree round (``tree``), and the stats (``stats``). It
takes plain values, never a recipe section, and imports only ``target``, ``errors``, ``files`` and
``devices``."""
