"""Compute kernels draftsmith ships for hardware that torch leaves slow (imports only torch).

``cpu_linear``: CPU linears whose cost is flat from 1 to 8 rows, the shape of a speculative
verification forward: a bf16 kernel of ours for AVX2 CPUs, and oneDNN's for fp32 (where torch's
MKL path is pathological for 2-7 rows).
"""
