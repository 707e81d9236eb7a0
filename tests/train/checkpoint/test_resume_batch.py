"""A run resumed on another layout keeps the checkpoint's global batch, or says that it changes."""

from paralm.data.sampler import BatchLayout
from paralm.train.checkpoint.resume_batch import keep_global_batch


def test_two_ranks_resumed_on_one_process_accumulate_twice_as_many_micro_batches():
    one_process = BatchLayout(1, 1, 4)
    layout, note = keep_global_batch(one_process, saved=8, explicit=0)
    assert (layout.grad_accum, layout.global_batch) == (2, 8)
    assert "keeps the checkpoint's global batch of 8" in note


def test_the_same_batch_says_nothing():
    layout = BatchLayout(2, 1, 4)
    assert keep_global_batch(layout, saved=8, explicit=0) == (layout, None)


def test_an_explicit_or_indivisible_batch_changes_it_and_says_so():
    layout = BatchLayout(4, 1, 4)
    assert keep_global_batch(layout, saved=8, explicit=16)[0] is layout
    kept, note = keep_global_batch(layout, saved=8, explicit=0)  # 8 is not a multiple of 4 x 4
    assert kept is layout and "changes from the checkpoint's 8 to 16" in note
