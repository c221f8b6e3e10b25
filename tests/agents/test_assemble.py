"""The assembly of an episode's calls into training sequences, on hand-built token ids."""

from posttrain.agents.assemble import Call, assemble


def call(order, prompt, sampled, lp=-1.0):
    return Call(order, list(prompt), list(sampled), [lp * (k + 1) for k in range(len(sampled))])


def test_appended_calls_make_one_sequence_with_their_gaps_masked():
    # call 0: prompt [1 2 3] -> sampled [4 5]; call 1: [1 2 3 4 5] + tool turn [8 9] -> sampled [6]
    out = assemble([call(0, [1, 2, 3], [4, 5]), call(1, [1, 2, 3, 4, 5, 8, 9], [6])], response_length=10)
    (seq,) = out.sequences
    assert seq.prompt == [1, 2, 3] and seq.tokens == [4, 5, 8, 9, 6] and seq.mask == [1, 1, 0, 0, 1]
    assert seq.log_probs == [-1.0, -2.0, 0.0, 0.0, -1.0] and seq.calls == 2
    assert out.retokenized_tokens == 0 and sum(out.splits.values()) == 0


def test_calls_are_joined_in_the_order_sent_not_answered():
    out = assemble([call(1, [1, 2, 3, 4, 7], [6]), call(0, [1, 2, 3], [4])], response_length=10)
    assert len(out.sequences) == 1 and out.sequences[0].tokens == [4, 7, 6]


def test_a_rewritten_reply_splits_and_counts_the_tokens_not_repeated():
    # context after call 0: [1 2 3 | 4 5]; call 1's prompt re-renders the reply as [4 9]: it differs at
    # position 4, inside the reply (which starts at 3): reply_rewritten; the context's tokens past the
    # first difference: 5 - 4 = 1 retokenized
    out = assemble([call(0, [1, 2, 3], [4, 5]), call(1, [1, 2, 3, 4, 9, 8], [6])], response_length=10)
    assert [s.prompt for s in out.sequences] == [[1, 2, 3], [1, 2, 3, 4, 9, 8]]
    assert [s.tokens for s in out.sequences] == [[4, 5], [6]]
    assert out.splits == {"branch": 0, "reply_rewritten": 1, "history_rewritten": 0} and out.retokenized_tokens == 1


def test_rewritten_history_before_the_last_reply():
    # three calls; the third drops the first reply [4]: it differs at position 3, before the second reply
    # (which starts at 6 in [1 2 3 4 8 | 5]): history_rewritten; context [1 2 3 4 8 5] (6) - common 3 = 3
    calls = [call(0, [1, 2, 3], [4]), call(1, [1, 2, 3, 4, 8], [5]), call(2, [1, 2, 3, 8, 5, 8], [6])]
    out = assemble(calls, response_length=10)
    assert out.splits["history_rewritten"] == 1 and out.retokenized_tokens == 3
    assert [s.mask for s in out.sequences] == [[1, 0, 1], [1]]


def test_a_retry_from_the_same_prompt_is_a_branch_and_a_later_call_continues_the_right_one():
    # two samples from [1 2]: the second is a branch (its prompt is a prefix of the first's context);
    # a third call continuing the first sample joins the first sequence
    calls = [call(0, [1, 2], [3]), call(1, [1, 2], [4]), call(2, [1, 2, 3, 9], [5])]
    out = assemble(calls, response_length=10)
    assert out.splits == {"branch": 1, "reply_rewritten": 0, "history_rewritten": 0} and out.retokenized_tokens == 0
    assert [s.tokens for s in out.sequences] == [[3, 9, 5], [4]]


def test_a_sequence_is_cut_at_the_response_length():
    # 2 sampled + 3 tool tokens + 4 sampled = 9 tokens after the prompt; cut at 6: 3 sampled ids lost
    out = assemble([call(0, [1], [2, 3]), call(1, [1, 2, 3, 7, 7, 7], [4, 5, 6, 8])], response_length=6)
    (seq,) = out.sequences
    assert seq.tokens == [2, 3, 7, 7, 7, 4] and out.truncated_tokens == 3
