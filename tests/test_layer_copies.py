"""Layer copies (CoCoServe's module replication and migration, nodes/inference/layer_copies.py) on the
tiny model: greedy tokens equal the model's without copies, also when replicas are added, evicted and
layers migrated with their KV in the middle of generation; each operation's bytes are the layer's
weights (and the KV it carried)."""

from __future__ import annotations

import pytest
import torch

from nodes.inference.checkpoint import load_whole
from nodes.inference.layer_copies import LayerCopies
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer
from tests.conftest import REPO

TINY = str(REPO / "examples" / "models" / "tiny")
PROMPTS = ["Once upon a time", "def main():\n    return", "The quick brown fox jumps over"]
STEPS = 12


@pytest.fixture(scope="module")
def model():
    return load_whole(TINY, dtype="float32")


def reference(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the plain model, the prompts prefilled then decoded as one packed batch."""
    caches = [model.new_cache() for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    new = prompts
    with torch.inference_mode():
        for _ in range(STEPS):
            hidden = model.run_layers(model.embed(torch.tensor([t for tokens in new for t in tokens])),
                                      [Segment(c, len(t)) for c, t in zip(caches, new, strict=True)])  # fmt: skip
            ends = torch.tensor([len(t) for t in new]).cumsum(0) - 1
            picked = model.logits(hidden[ends]).argmax(-1).tolist()
            for out, token in zip(outputs, picked, strict=True):
                out.append(token)
            new = [[t] for t in picked]
    return outputs


def with_copies(model, prompts: list[list[int]], operations) -> tuple[list[list[int]], LayerCopies, list[int]]:
    """The same generation on layer copies; ``operations[step](copies, sequences)`` runs before ``step``
    and returns the bytes it moved. The third prompt is admitted at step 3 (after the first changes)."""
    copies = LayerCopies(model, "g0")
    sequences, news, outputs, moved = [], [], [[] for _ in prompts], []
    with torch.inference_mode():
        for step in range(STEPS + 3):
            if step in operations:
                moved.append(operations[step](copies, sequences))
            if len(sequences) < len(prompts) and (step == 0 or step == 3):
                for k in (range(2) if step == 0 else [2]):
                    sequences.append(copies.admit())
                    news.append(prompts[k])
            live = [k for k in range(len(sequences)) if len(outputs[k]) < STEPS]
            if not live:
                break
            tokens = [t for k in live for t in news[k]]
            hidden = copies.run_layers(model.embed(torch.tensor(tokens)), [(sequences[k], len(news[k])) for k in live])
            ends = torch.tensor([len(news[k]) for k in live]).cumsum(0) - 1
            picked = model.logits(hidden[ends]).argmax(-1).tolist()
            for k, token in zip(live, picked, strict=True):
                outputs[k].append(token)
                news[k] = [token]
    return outputs, copies, moved


def test_tokens_are_the_models_with_replicas_migrations_and_evictions_mid_generation(model) -> None:
    tokenizer = Tokenizer(TINY)
    prompts = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in PROMPTS]
    expected = reference(model, prompts)
    layers = model.config.num_hidden_layers

    def replicate_middle(copies, sequences):  # before anyone is admitted: both first sequences use them
        return sum(copies.replicate(i, "g1") for i in range(2, 6))

    def mid_generation(copies, sequences):  # two sequences hold KV: move and drop copies under them
        moved = copies.migrate(layers - 1, "g0", "g2", sequences)
        moved += copies.evict(3, "g1", sequences)
        return moved + copies.replicate(0, "g3")  # serves the third sequence (admitted at step 3) only

    def migrate_a_replica(copies, sequences):
        return copies.migrate(2, "g1", "g3", sequences)

    outputs, copies, moved = with_copies(model, prompts, {0: replicate_middle, 2: mid_generation, 6: migrate_a_replica})
    assert outputs == expected
    # where the layers ended up, and whose KV lives where
    assert copies.hosts[layers - 1] == ["g2"] and copies.hosts[3] == ["g0"] and copies.hosts[0] == ["g0", "g3"]
    assert copies.hosts[2] == ["g0", "g3"] and copies.hosts[4] == ["g0", "g1"]
    # bytes moved: weights of each layer copied or migrated, and the KV of the sequences a migrated or
    # evicted copy served (a float32 token of one layer: keys and values of 4 heads x 32 dims)
    layer_bytes, per_token = copies.layer_bytes(0), 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    first, second = (len(prompts[0]) + 1, len(prompts[1]) + 1)  # their lengths before step 2
    assert moved[0] == 4 * layer_bytes  # four layers' weights, nobody's KV yet
    # layer 7's weights and both sequences' KV; layer 3's replica served the second sequence; layer 0's weights
    assert moved[1] == 2 * layer_bytes + per_token * (first + second) + per_token * second
    assert moved[2] == layer_bytes + per_token * (len(prompts[1]) + 5)  # g1's copy of layer 2 served the second


def test_admission_alternates_over_a_layers_copies_and_kv_stays_where_it_was_served(model) -> None:
    copies = LayerCopies(model, "g0")
    copies.replicate(1, "g1")
    a, b, c = copies.admit(), copies.admit(), copies.admit()
    assert [s.serving[1] for s in (a, b, c)] == ["g0", "g1", "g0"] and a.serving[0] == b.serving[0] == "g0"
    with torch.inference_mode():
        copies.run_layers(model.embed(torch.tensor([0, 5, 6, 0, 7])), [(a, 3), (b, 2)])
    assert set(b.caches) == {"g0", "g1"} and set(a.caches) == {"g0"}
    layers = model.config.num_hidden_layers  # b's layer 1 lives on g1 alone, its other layers on g0
    assert b.caches["g1"].nbytes() * layers == a.caches["g0"].nbytes()
    assert b.caches["g0"].nbytes() * layers == (layers - 1) * a.caches["g0"].nbytes()
    with pytest.raises(ValueError, match="already on g1"):
        copies.replicate(1, "g1")
    with pytest.raises(ValueError, match="no replica"):
        copies.evict(0, "g1", [a, b])
