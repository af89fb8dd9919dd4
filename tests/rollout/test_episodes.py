"""An agent episode's turns strung into consistent chains (services/rollout/episodes.py)."""

from __future__ import annotations

import torch

from services.rollout.episodes import Turn, chains, episode_columns


def turn(prompt, output, version=0):
    return Turn(list(prompt), list(output), [-0.5 - k for k in range(len(output))], [version] * len(output))


def test_turns_that_extend_the_context_make_one_chain_with_inserted_tokens_masked():
    first = turn([1, 2, 3], [10, 11], version=4)
    second = turn([1, 2, 3, 10, 11, 20, 21], [12], version=5)  # 20, 21: a tool result the agent inserted
    [chain] = chains([first, second])
    assert chain.prompt_ids == [1, 2, 3] and chain.turns == 2
    assert chain.response_ids == [10, 11, 20, 21, 12]
    assert chain.loss_mask == [1, 1, 0, 0, 1]
    assert chain.log_probs == [-0.5, -1.5, 0.0, 0.0, -0.5]
    assert chain.versions == [4, 4, 5, 5, 5]  # inserted tokens take the version of the output after them
    assert chain.model_tokens == 3 and chain.begin_version == 4


def test_a_rewritten_history_starts_a_new_chain_and_a_branch_rejoins_its_own():
    a = turn([1, 2], [10])
    rewrite = turn([1, 9], [30])  # the history changed: not a continuation of a
    back_to_a = turn([1, 2, 10, 7], [11])  # continues a (the earlier chain), not the rewrite
    after_rewrite = turn([1, 9, 30, 8], [31])
    first, second = chains([a, rewrite, back_to_a, after_rewrite])
    assert (first.prompt_ids, first.response_ids, first.loss_mask) == ([1, 2], [10, 7, 11], [1, 0, 1])
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([1, 9], [30, 8, 31], [1, 0, 1])


def test_a_shorter_prompt_than_the_context_never_continues_it():
    a = turn([1, 2, 3], [4])
    shorter = turn([1, 2], [5])  # a prefix of a's context: a new chain, not a continuation
    assert len(chains([a, shorter])) == 2


def test_episode_columns_keep_each_samples_own_prompt_and_mask():
    one = chains([turn([1, 2], [3, 4])])[0]
    two = chains([turn([5], [6]), turn([5, 6, 7], [8])])[0]
    cols = episode_columns(3, [one, two], [1.0, 0.5], step=2)
    assert [t.tolist() for t in cols["tokens"]] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert cols["prompt_length"].tolist() == [2, 1] and cols["response_length"].tolist() == [2, 3]
    assert [m.tolist() for m in cols["loss_mask"]] == [[1, 1], [1, 0, 1]]
    assert torch.equal(cols["reward"], torch.tensor([1.0, 0.5]))
    assert cols["prompt_position"].tolist() == [3, 3] and cols["sample_index"].tolist() == [0, 1]
    assert all(len(v) == len(m) for v, m in zip(cols["token_weight_versions"], cols["loss_mask"]))
