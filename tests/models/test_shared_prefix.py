"""use_prefix_grouper: each distinct prompt encoded once for all its responses. Compared in float64
with the plain forward on the same weights (the reference: every row encodes its own prompt):
log-probs, entropies and every gradient; then the micro-batch grouping and the trainer wiring.

transformers' Llama RMSNorm computes in float32 whatever the model's dtype, so a float64 model still
rounds there: the gradient reaching a shared prompt token is summed over its responses *before*
that float32 step, and over rows *after* it in the plain forward (a 1e-7 relative difference, more
where terms cancel). The float64 comparisons swap in a float64 RMSNorm to compare the layouts alone.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.tiny_models import tiny_llama
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import response_logprobs
from posttrain.models import shared_prefix as sp
from posttrain.models.microbatch import forward_micro_batches


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def float64_norm(monkeypatch):
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _grouped_batch(prompt_len=12, resp_len=5, sizes=(4, 3, 1), seed=0):
    """Rows of ``len(sizes)`` prompts (``sizes[g]`` responses each), shuffled; prompts left-padded by
    different amounts, responses ending at different lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, size in enumerate(sizes):
        prompt = torch.randint(6, 40, (prompt_len,), generator=g)
        pad = 2 * k  # each prompt its own left padding
        for _ in range(size):
            resp = torch.randint(6, 40, (resp_len,), generator=g)
            mask = torch.ones(prompt_len + resp_len, dtype=torch.long)
            mask[:pad] = 0
            mask[prompt_len + int(torch.randint(1, resp_len + 1, (1,), generator=g)):] = 0
            rows.append((torch.cat([prompt, resp]), mask))
    order = torch.randperm(len(rows), generator=g)
    ids = torch.stack([rows[i][0] for i in order])
    mask = torch.stack([rows[i][1] for i in order])
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return ids, mask, pos, ids[:, prompt_len:]


def _run(model, batch, shared):
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, *batch, temperature=0.7, calculate_entropy=True, shared_prefix=shared)
    (lp.sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _spy(monkeypatch, builder: str = "build_tree_layout") -> list:
    """Record what ``builder`` returned (a layout, or None when the plain forward ran)."""
    seen, real = [], getattr(sp, builder)
    monkeypatch.setattr(sp, builder, lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    return seen


def _common_beginning(batch, length: int, seed: int = 1):
    """The same batch with every prompt's first ``length`` valid tokens made equal (a system prompt)."""
    ids, mask, pos, resp = (x.clone() for x in batch)
    prompt_len = ids.shape[1] - resp.shape[1]
    beginning = torch.randint(6, 40, (length,), generator=torch.Generator().manual_seed(seed))
    for row in range(ids.shape[0]):
        start = int((mask[row, :prompt_len] == 0).sum())
        ids[row, start:start + length] = beginning
    return ids, mask, pos, ids[:, prompt_len:]


def _assert_same_run(got, want, tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **tol, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prefix_equals_plain_forward(tok, monkeypatch, float64_norm, attention):
    """sdpa (posttrain's CPU attention) takes the one-row layout's blocks, in float64; eager the
    one-row-per-prompt layout's additive mask, in float32 (its softmax runs in float32, and in a
    float64 model transformers' own padded eager forward gives NaN)."""
    model = tiny_llama(tok, attn_implementation=attention)
    if attention == "sdpa":
        model, tol = model.double(), dict(rtol=1e-12, atol=1e-12)
    else:
        tol = dict(rtol=1e-4, atol=1e-5)
    batch = _grouped_batch()
    want = _run(model, batch, shared=False)
    seen = _spy(monkeypatch, "build_tree_layout" if attention == "sdpa" else "build_layout")
    got = _run(model, batch, shared=True)
    assert len(seen) == 1 and seen[0] is not None
    if attention == "sdpa":  # 3 prompts (12, 10 and 8 tokens after their padding) once, then the responses
        assert seen[0].input_ids.shape[1] == 12 + 10 + 8 + int(batch[1][:, 12:].sum())
    else:
        assert seen[0].input_ids.shape[0] == 3
    _assert_same_run(got, want, tol)


@pytest.mark.parametrize("sizes", [(4, 3, 1), (1, 1, 1)])
def test_a_beginning_every_prompt_shares_is_encoded_once(tok, monkeypatch, float64_norm, sizes):
    """Prompts that begin alike (5 tokens, at the same positions after different left padding): the
    beginning is one block of the row, also when every prompt is asked once; float64 log-probs,
    entropies and every gradient equal the plain forward's. Negative control: a layout that shares
    one token more than the prompts have in common (the sixth differs) does not."""
    model = tiny_llama(tok).double()
    batch = _common_beginning(_grouped_batch(sizes=sizes), 5)
    want = _run(model, batch, shared=False)
    seen = _spy(monkeypatch)
    got = _run(model, batch, shared=True)
    assert seen[0] is not None and seen[0].shared_len == 5
    _assert_same_run(got, want, dict(rtol=1e-12, atol=1e-12))
    monkeypatch.setattr(sp, "shared_beginning", lambda *a: 6)
    wrong = _run(model, batch, shared=True)
    assert (wrong[0] - want[0]).abs().max() > 1e-3


def test_each_response_reads_exactly_its_own_row():
    """The one-row layout read back: the keys a response's last token attends to are its own row's
    valid tokens, in order, at their positions (the shared beginning, its prompt's own tokens, its
    response), for every row; and every column's output comes from exactly one block row."""
    ids, mask, pos, resp = _common_beginning(_grouped_batch(), 4)
    tree = sp.build_tree_layout(ids, mask, pos, resp.shape[1], hidden_size=64)
    assert tree is not None and tree.shared_len == 4
    responses = tree.blocks.blocks[-1]
    flat_ids, flat_pos = tree.input_ids[0], tree.position_ids[0]
    for row in range(ids.shape[0]):
        last = int(mask[row, 12:].sum()) - 1  # the response's last valid token
        seen = responses.key_cols[row][responses.mask[row, 0, last]]
        valid = mask[row].bool()
        assert flat_ids[seen].tolist() == ids[row][valid].tolist()
        assert flat_pos[seen].tolist() == pos[row][valid].tolist()
    outputs = sum(block.query_cols.numel() for block in tree.blocks.blocks)
    assert sorted(set(tree.blocks.source_rows.tolist())) == sorted(tree.blocks.source_rows.tolist())
    assert int(tree.blocks.source_rows.max()) < outputs


def test_shared_prefix_under_bf16_autocast_uses_the_cpu_attention(tok, monkeypatch):
    """bf16 autocast on CPU attends with posttrain's matmul attention, which must honour the 4D mask: by
    blocks, the prompts' own tokens ``[G, 1, P', P']`` and the responses' ``[B, 1, R, P' + R]``."""
    from posttrain.models import attention as attn

    calls, real = [], attn.matmul_attention
    monkeypatch.setattr(attn, "matmul_attention", lambda *a, **k: calls.append(a[4].shape) or real(*a, **k))
    model = tiny_llama(tok)
    batch = _grouped_batch()
    with torch.no_grad():
        want = response_logprobs(model, *batch)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = response_logprobs(model, *batch)[0]
            calls.clear()
            got = response_logprobs(model, *batch, shared_prefix=True)[0]
    layers = len(model.model.layers)
    assert calls == [(3, 1, 12, 12), (8, 1, 5, 12 + 5)] * layers  # 3 prompts (<= 12 tokens), 8 responses (<= 5)
    # as close to the float32 result as the plain bf16 forward is
    assert (got - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-3


def test_kernels_without_a_dense_mask_run_the_plain_forward(tok, monkeypatch):
    model = tiny_llama(tok)
    model.config._attn_implementation = "flash_attention_2"
    assert sp.shared_prefix_hidden_states(model.model, *_grouped_batch()[:3], 5) is None


def test_responses_never_see_their_siblings(tok, float64_norm):
    """Negative control: the same layout with sibling slots visible to each other changes the hidden
    states, so the equality above depends on the mask keeping them apart."""
    model = tiny_llama(tok).double()
    ids, mask, pos, resp = _grouped_batch()
    layout = sp.build_layout(ids, mask, pos, resp.shape[1], model.config.hidden_size)
    width = layout.input_ids.shape[1]
    leaky = layout.mask | torch.ones(width, width, dtype=torch.bool).tril()  # causal over all slots
    with torch.no_grad():
        run = lambda m: model.model(input_ids=layout.input_ids, attention_mask=m, position_ids=layout.position_ids,  # noqa: E731
                                    use_cache=False).last_hidden_state[layout.group[:, None], layout.predict_cols]
        kept, leaked = run(layout.mask), run(leaky)
    valid = mask[:, -resp.shape[1]:].bool()
    assert (kept - leaked)[valid].abs().max() > 1e-3


def test_plain_forward_when_nothing_is_shared_or_grouping_costs_more(tok, monkeypatch, float64_norm):
    """All prompts distinct with no common beginning: the one-row layout has nothing to share. One prompt
    with two long answers beside four prompts with one each: every row of the one-row-per-prompt
    layout (eager) is as wide as the first prompt's two answers, so it would compute more. Both run
    the plain forward (and give the same numbers; eager in float32, see the equality test)."""
    for attention, builder, batch in (
            ("sdpa", "build_tree_layout", _grouped_batch(sizes=(1, 1, 1))),
            ("eager", "build_layout", _grouped_batch(prompt_len=3, resp_len=40, sizes=(2, 1, 1, 1, 1)))):
        model = tiny_llama(tok, attn_implementation=attention)
        model = model.double() if attention == "sdpa" else model
        seen = _spy(monkeypatch, builder)
        with torch.no_grad():
            want = response_logprobs(model, *batch, shared_prefix=False)[0]
            got = response_logprobs(model, *batch, shared_prefix=True)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert seen == [None], attention


def test_the_dense_mask_costs_more_than_blocks_with_long_answers():
    """Two prompts of 3 tokens with two 40-token answers each: over a dense mask the [L, L] pairs cost
    more than the prompt copies save; by blocks (each answer attends to its prompt and itself) they do not."""
    ids, mask, pos, resp = _grouped_batch(prompt_len=3, resp_len=40, sizes=(2, 2))
    mask[:, 3:] = 1  # every answer its full 40 tokens
    assert sp.build_layout(ids, mask, pos, resp.shape[1], hidden_size=16) is None
    assert sp.build_tree_layout(ids, mask, pos, resp.shape[1], hidden_size=16) is not None


def test_a_shared_beginning_needs_the_same_positions():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9]])
    lengths = torch.tensor([4, 4])
    assert sp.shared_beginning(tokens, torch.arange(4).expand(2, 4), lengths) == 2
    assert sp.shared_beginning(tokens, torch.tensor([[0, 1, 2, 3], [0, 2, 3, 4]]), lengths) == 1
    assert sp.shared_beginning(tokens[:, :2], torch.arange(2).expand(2, 2), torch.tensor([2, 2])) == 1  # one token kept


def test_same_tokens_at_other_positions_are_not_shared():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    mask = torch.ones_like(ids)
    pos = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]])
    group, count = sp.prompt_groups(ids, mask, pos, response_length=1)
    assert count == 2 and group[0] != group[1]
    group, count = sp.prompt_groups(ids, mask, torch.tensor([[0, 1, 2, 3]] * 2), response_length=1)
    assert count == 1


def test_micro_batches_keep_a_prompts_rows_together():
    prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [-1, 5], [1, 2]])
    mask = torch.ones(6, 5, dtype=torch.long)
    groups = forward_micro_batches(mask, 3, prompts=prompts)
    assert sorted(sorted(g.tolist()) for g in groups) == [[0, 2, 5], [1, 3], [4]]  # whole prompts, <= 3 rows
    groups = forward_micro_batches(mask, 2, prompts=prompts)  # a prompt with more rows than fit: split
    assert max(len(g) for g in groups) == 2 and sorted(torch.cat(groups).tolist()) == list(range(6))
    assert [sorted(g.tolist()) for g in groups if 1 in g.tolist()] == [[1, 3]]


def _shared_prefix_cost(mask, prompts, rows) -> int:
    """Tokens the shared-prefix forward computes for ``rows``: each distinct prompt once, every response padded
    to the group's longest (the reference for `shared_prefix_by_tokens`' budget, computed another way)."""
    width = prompts.shape[1]
    distinct = {tuple(prompts[r].tolist()): int(mask[r, :width].sum()) for r in rows}
    return sum(distinct.values()) + len(rows) * max(int(mask[r, width:].sum()) for r in rows)


def test_micro_batches_by_tokens_keep_whole_prompts_within_the_budget():
    """use_dynamic_bsz with shared prompts: every row once, each group within the token budget as the
    shared-prefix forward computes it, whole prompts where they fit (two per group here), a prompt too big
    for one group split into groups of as many rows as fit; the plain token split (the old behaviour, the
    negative control) breaks prompts apart."""
    ids, mask, _, resp = _grouped_batch(prompt_len=12, resp_len=5, sizes=(4, 3, 1, 2))
    prompts = sp.prompt_key(ids, mask, resp.shape[1])
    budget = 40
    groups = forward_micro_batches(mask, None, use_dynamic_bsz=True, max_token_len=budget, prompts=prompts)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(ids)))
    for rows in groups:
        assert _shared_prefix_cost(mask, prompts, rows.tolist()) <= budget, rows
    prompt_of = [tuple(p.tolist()) for p in prompts]

    def groups_of_each_prompt(split):
        return [sum(prompt_of[r] in {prompt_of[x] for x in rows.tolist()} for rows in split) for r in range(len(ids))]

    assert max(groups_of_each_prompt(groups)) == 1  # every prompt fits whole within 40 tokens: none split
    assert max(len({prompt_of[r] for r in rows.tolist()}) for rows in groups) >= 2  # prompts share a group
    plain = forward_micro_batches(mask, None, use_dynamic_bsz=True, max_token_len=budget)
    assert max(groups_of_each_prompt(plain)) > 1  # the plain token split scatters a prompt's rows
    tight = forward_micro_batches(mask, None, use_dynamic_bsz=True, max_token_len=20, prompts=prompts)
    assert sorted(torch.cat(tight).tolist()) == list(range(len(ids)))
    for rows in tight:
        assert len(rows) == 1 or _shared_prefix_cost(mask, prompts, rows.tolist()) <= 20, rows
    assert len(tight) > len(groups)
    with pytest.raises(ValueError, match="max_token_len"):
        forward_micro_batches(mask, None, use_dynamic_bsz=True, max_token_len=None, prompts=prompts)


def test_log_probs_by_token_budget_with_shared_prompts_equal_one_plain_forward(tok):
    """The groups `shared_prefix_by_tokens` makes give the same log-probs as one micro-batch of every row."""
    from posttrain.models import compute_response_logprobs

    model = tiny_llama(tok).eval()
    ids, mask, pos, resp = _grouped_batch(sizes=(4, 3, 1, 2))
    data = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": resp}
    want, _ = compute_response_logprobs(model, data, len(ids), 0.7, False)
    got, _ = compute_response_logprobs(model, data, None, 0.7, False, use_dynamic_bsz=True, max_token_len=30,
                                       shared_prefix=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tiny_grpo_run_with_prefix_grouper_equals_plain_run(tmp_path, monkeypatch):
    """The key reaches the old-log-prob, reference and update forwards; step 1 (same weights, same
    samples) has the plain run's losses and the engine's log-probs agree with the grouped scorer."""
    from helpers.tiny_run import tiny_trainer

    common = ["actor_rollout_ref.actor.use_kl_loss=True", "trainer.total_training_steps=2",
              "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2"]
    plain = tiny_trainer(tmp_path / "plain", common)
    grouped = tiny_trainer(tmp_path / "grouped", common + ["actor_rollout_ref.actor.use_prefix_grouper=True"])
    want = plain.fit()
    seen = _spy(monkeypatch)
    got = grouped.fit()
    assert any(layout is not None for layout in seen)  # prompts were shared in the real run
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-4, abs=1e-6), key
    assert max(row["training/rollout_actor_probs_diff_max"] for row in got) < 1e-4


def _random_tree_attention(seed=0):
    """q/k/v of a one-row layout: 3 prompts (one left-padded) beginning with the same 3 tokens, 2
    responses each (one ending early), grouped-query heads, float64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 40, (6, 10), generator=g)
    for first in (0, 2, 4):  # rows first, first + 1 share a prompt
        ids[first + 1, :6] = ids[first, :6]
    mask = torch.ones_like(ids)
    mask[4:, :1] = 0
    ids[:4, :3] = ids[4:, 1:4][0]  # the same 3 first tokens in every prompt
    ids[5, 1:4] = ids[4, 1:4]
    mask[1, 8:] = 0
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    tree = sp.build_tree_layout(ids, mask, pos, 4, hidden_size=64)
    assert tree is not None and tree.shared_len == 3
    width = tree.input_ids.shape[1]
    q = torch.randn(1, 4, width, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, width, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return tree.blocks, q, k, v


def _dense_mask(blocks) -> torch.Tensor:
    """``[1, 1, W, W]``: for each column, the mask row of the block row its output is taken from."""
    width = blocks.source_rows.shape[0]
    dense = torch.zeros(width, width, dtype=torch.bool)
    offset = 0
    for block in blocks.blocks:
        rows, per_row = block.query_cols.shape
        for n in range(rows):
            for i in range(per_row):
                col = int(block.query_cols[n, i])
                if int(blocks.source_rows[col]) == offset + n * per_row + i:
                    dense[col, block.key_cols[n][block.mask[n, 0, i]]] = True
        offset += rows * per_row
    return dense[None, None]


def _attention_module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # as a Llama attention with 4 query and 2 kv heads
    return module


def _dense_attention(q, k, v, mask):
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_block_attention_equals_the_dense_mask():
    """By blocks (the shared beginning, each prompt's own tokens, each response) equals attention over
    the dense [W, W] mask the blocks describe, in float64: the output and the gradients of q, k and v
    (a shared key's gradient summed over every block that reads it)."""
    from posttrain.models.attention import block_attention

    blocks, q, k, v = _random_tree_attention()
    module, dense = _attention_module(), _dense_mask(blocks)
    assert dense[0, 0].sum(1).min() >= 1 and not dense[0, 0].triu(1).any()  # every column attends, never ahead
    outs = []
    for fn in (lambda *t: _dense_attention(*t, dense), lambda *t: block_attention(module, *t, blocks)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append([out.detach()] + [x.grad for x in leaves])
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_block_attention_reads_the_mask_inside_a_response():
    """Negative control: a query that its block's mask lets see a later token of its own response sees
    it by blocks too (the causal rule comes from the mask, not from an assumption), and the output moves."""
    from posttrain.models.attention import AttentionBlocks, QueryBlock, block_attention

    blocks, q, k, v = _random_tree_attention()
    responses = blocks.blocks[-1]
    leaky_mask = responses.mask.clone()
    offset = responses.key_cols.shape[1] - responses.query_cols.shape[1]
    leaky_mask[0, 0, 0, offset + 2] = True  # row 0's first response token sees its third
    leaky = AttentionBlocks(blocks.blocks[:-1] + (QueryBlock(responses.query_cols, responses.key_cols, leaky_mask),),
                            blocks.source_rows)
    got = block_attention(_attention_module(), q, k, v, leaky)
    torch.testing.assert_close(got, _dense_attention(q, k, v, _dense_mask(leaky)), rtol=1e-12, atol=1e-12)
    kept = block_attention(_attention_module(), q, k, v, blocks)
    first = int(responses.query_cols[0, 0])
    assert (got - kept)[0, first].abs().max() > 1e-3


def test_block_attention_runs_under_the_cpu_attention_only(tok, monkeypatch):
    """sdpa (switched to posttrain's CPU attention) attends by blocks; eager gets the dense mask."""
    from posttrain.models import attention as attn

    calls, real = [], attn.block_attention
    monkeypatch.setattr(attn, "block_attention", lambda *a, **k: calls.append(len(a[4].blocks)) or real(*a, **k))
    for implementation, want in (("sdpa", [2]), ("eager", [])):
        calls.clear()
        with torch.no_grad():
            response_logprobs(tiny_llama(tok, attn_implementation=implementation), *_grouped_batch(), shared_prefix=True)
        assert sorted(set(calls)) == want, implementation


def _repeated_columns(seed=0):
    """A micro-batch's shape on SmolLM2-135M: 394 layout columns of width 576; four responses whose first
    token all read the prompt's last column (89), and a tail clamped to the last column."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(394, 576, generator=g)
    cols = torch.cat([torch.full((4, 1), 89), torch.randint(90, 394, (4, 95), generator=g)], dim=1)
    cols[:, 60:] = 393
    grad = torch.randn(4, 96, 576, generator=g) * 1e-4
    return hidden, cols, grad


def _gradient_bits(select, hidden, cols, grad) -> bytes:
    x = hidden.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(select(x, cols), x, grad)
    return dx.numpy().tobytes()


def test_take_columns_is_indexing_with_a_gradient_that_sums_repeats():
    hidden, cols, grad = _repeated_columns()
    assert torch.equal(sp.take_columns(hidden, cols), hidden[cols])
    x = hidden.double().requires_grad_(True)
    (dx,) = torch.autograd.grad(sp.take_columns(x, cols), x, grad.double())
    expected = torch.zeros_like(hidden, dtype=torch.float64)
    for b in range(cols.shape[0]):  # the reference: one add per (row, step), in a float64 loop
        for t in range(cols.shape[1]):
            expected[cols[b, t]] += grad[b, t].double()
    torch.testing.assert_close(dx, expected, rtol=0, atol=1e-15)


def test_take_columns_gives_the_same_gradient_bits_on_every_call():
    """The reason `take_columns` exists: advanced indexing's CPU backward adds a repeated column's
    gradients in parallel in a varying order (the control), which made one seed's retry runs end at
    +28.9 or +32.8 held-out points; index_select's backward does not."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one thread adds in a fixed order, and the control would show nothing")
    torch.set_num_threads(2)  # (the suite's one thread is restored after the test)
    hidden, cols, grad = _repeated_columns()
    runs = {_gradient_bits(sp.take_columns, hidden, cols, grad) for _ in range(30)}
    assert len(runs) == 1
    control = {_gradient_bits(lambda x, c: x[c], hidden, cols, grad) for _ in range(30)}
    assert len(control) > 1, "advanced indexing's backward was deterministic here: the control shows nothing"
