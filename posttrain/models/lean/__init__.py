"""How a trained model's backward is made cheap in memory; none of it changes a number.

- `head`: the LM head's log-probs as one autograd node that keeps bf16 logits (or none) and walks the
  vocabulary in slices in backward (the actor update's former peak);
- `backward`: decoder layers that keep less for backward (the fp32 weights rather than a bf16 cast of each,
  the norms' inputs rather than their outputs; `keep_less_for_backward`);
- `into_grad`: weight gradients summed into ``.grad`` inside the micro-step rather than held by autograd
  (the head's, the input embedding's rows).

Attention's own recomputation (probabilities rebuilt in backward, not kept) stays in
`posttrain.models.attention`, whose score and mask arithmetic it shares with the decoding path.
Each piece is switched on by the placement (`posttrain.distributed.placement.InProcess.shard`) or by the
update engine's micro-step (`posttrain.workers.actor`); `posttrain.models.logprobs` calls `head`.
"""
