"""Compute kernels draftsmith ships for hardware that torch leaves slow (imports only torch).

``cpu_linear``: a bf16 linear for AVX2 CPUs whose cost is flat from 1 to 8 rows, the shape of a
speculative verification forward.
"""
