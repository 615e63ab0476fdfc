"""Sampling settings every lossless suite runs: greedy and two seeded (coupled) samplers."""

from diffspec.core.sampling import SamplingParams

GREEDY = SamplingParams()
SAMPLINGS = {
    "greedy": GREEDY,
    "seed1_t0.8": SamplingParams(temperature=0.8, seed=1),
    "seed2_t1_topk_topp": SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2),
}
