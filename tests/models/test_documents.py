"""Document masks: a packed sequence's logits, document by document, equal each document run alone
(attention stays inside each document and positions restart at its start), for both families."""

import pytest
import torch

from paralm.models.documents import document_mask, document_positions
from paralm.models.registry import model_config, model_spec
from tests.helpers import widened

# fp32, the same sums in another order (a masked row holds zeros where the lone run has nothing): a few ulps
TOLERANCE = 1e-5


def test_positions_and_mask_restart_at_each_document():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert document_positions(documents).tolist() == [[0, 1, 0, 1, 2, 0]]
    mask = document_mask(documents)[0]
    assert mask[4].tolist() == [False, False, True, True, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]


@pytest.mark.parametrize(
    "family, fields",
    [("gpt2", {}), ("llama", {"n_kv_heads": 2, "tie_embeddings": False})],
)
def test_a_packed_sequence_gives_each_document_its_own_logits(family, fields):
    config = model_config(
        family=family, n_layer=2, n_head=4, d_model=32, block_size=24, vocab_size=64, dropout=0.0, **fields
    )
    torch.manual_seed(0)
    model = widened(model_spec(config).build(config).eval())
    lengths = [7, 12, 5]
    docs = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        together = model(packed, documents=ids)
        alone = torch.cat([model(d) for d in docs], dim=1)
        unmasked = model(packed)
    torch.testing.assert_close(together, alone, rtol=0, atol=TOLERANCE)
    assert (unmasked[:, lengths[0] :] - alone[:, lengths[0] :]).abs().max() > 1e-2  # the mask matters
