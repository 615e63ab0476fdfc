"""The engine-free core: one implementation of every rule, shared by the reference
decoder and by both engine adapters.

Vocabulary (used everywhere in diffspec, defined once here):

* **view**: a way of running one model. The *AR view* is the ordinary causal model;
  the *diffusion view* runs (some of) the same weights bidirectionally over a block.
* **anchor**: the last committed token; it is not yet in the KV cache. A step's
  input block is ``[anchor, <mask> x (K-1)]``.
* **block** (size ``K``): the tokens processed together in one diffusion pass.
* **mask token**: the placeholder id the diffusion view fills in (``mask_token_id``).
* **draft**: tokens proposed by the drafter (diffusion view). ``draft_token_ids`` are
  padded with the placeholder id ``-1`` (:data:`PLACEHOLDER_TOKEN_ID`).
* **verify**: one causal AR pass over ``[anchor, d_1 .. d_n]`` giving target logits
  for ``n + 1`` positions.
* **accept**: the accepted tokens are the longest draft prefix the target agrees with
  (greedy) or that passes rejection sampling; then one more token is emitted:
  a **recovered** token (sampled from the residual, or the target argmax, at the
  first rejected position) or, when every draft was accepted, a **bonus** token
  (from the target's last position).
* **commit**: make the accepted tokens (and the recovered/bonus token as the next
  anchor) part of the request; KV beyond the committed length is rolled back by
  moving the length, never by copying.
* **slot** (ReFusion): a contiguous span of masked positions planned and filled as a unit.
* **TPF**: tokens per forward = generated tokens / forward passes (a draft + verify
  cycle counts two forwards).

Submodules import torch (``adaptive`` does not); this package file does not.
"""

PLACEHOLDER_TOKEN_ID = -1
