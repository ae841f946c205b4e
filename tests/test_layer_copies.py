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


def with_copies(model, prompts: list[list[int]], operations,
                copies: LayerCopies | None = None) -> tuple[list[list[int]], LayerCopies, list[int]]:  # fmt: skip
    """The same generation on layer copies; ``operations[step](copies, sequences)`` runs before ``step``
    and returns the bytes it moved. The third prompt is admitted at step 3 (after the first changes)."""
    copies = copies if copies is not None else LayerCopies(model, "g0")
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


def test_a_request_out_of_memory_fails_and_the_others_keep_their_tokens(model) -> None:
    """A budget on the replica's GPU that holds the layers' weights and two sequences' KV but not a
    third's: at the step where the KV would overflow, the newest sequence fails (an OOM, counted), and
    the two others go on with the plain model's tokens."""
    from nodes.scaling.memory_budget import MemoryCosts, SequenceUse, out_of_memory

    tokenizer = Tokenizer(TINY)
    prompts = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in PROMPTS]
    expected = reference(model, prompts)
    copies = LayerCopies(model, "g1")  # g1 holds the whole model; g2 a replica of every layer
    for layer in range(model.config.num_hidden_layers):
        copies.replicate(layer, "g2")
    layers, per_token = model.config.num_hidden_layers, 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    costs = MemoryCosts(copies.layer_bytes(0), per_token)
    sequences = [copies.admit() for _ in prompts]  # g1, g2, g1 for every layer
    assert [s.serving[0] for s in sequences] == ["g1", "g2", "g1"]
    room = layers * (costs.layer_bytes + per_token * (len(prompts[0]) + len(prompts[2]) + 2 * STEPS - 4))
    budgets = {"g1": room}  # the first and third fit until a few tokens before the end
    news, outputs, failed = list(prompts), [[] for _ in prompts], []
    with torch.inference_mode():
        for _ in range(STEPS):
            live = [k for k in range(3) if k not in failed]
            uses = [SequenceUse(k, sequences[k].serving, sequences[k].length, len(news[k])) for k in live]
            failed += out_of_memory(copies.hosts, uses, costs, budgets)[0]
            live = [k for k in range(3) if k not in failed]
            hidden = copies.run_layers(model.embed(torch.tensor([t for k in live for t in news[k]])),
                                       [(sequences[k], len(news[k])) for k in live])  # fmt: skip
            ends = torch.tensor([len(news[k]) for k in live]).cumsum(0) - 1
            for k, token in zip(live, model.logits(hidden[ends]).argmax(-1).tolist(), strict=True):
                outputs[k].append(token)
                news[k] = [token]
    assert failed == [2]  # the newest on the overfull GPU; the one on g2 is not in its way
    assert outputs[0] == expected[0] and outputs[1] == expected[1]
    assert 0 < len(outputs[2]) < STEPS and outputs[2] == expected[2][: len(outputs[2])]


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


RANKS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from mpi4py import MPI
from nodes.inference.checkpoint import load_whole
from nodes.inference.layer_copies import LayerCopies
from nodes.inference.tokenizer import Tokenizer
from nodes.workers.engines.layer_ranks import CopyServer, RemoteGpu
from tests.test_layer_copies import PROMPTS, TINY, reference, with_copies

comm = MPI.COMM_WORLD
if comm.Get_rank() > 0:
    server = CopyServer(comm, TINY)
    server.serve()
    said = {"rank": comm.Get_rank(), "runs": server.runs, "layers": sorted(server.modules)}
    open("%s/rank%d.json" % (sys.argv[2], comm.Get_rank()), "w").write(json.dumps(said))
else:
    model = load_whole(TINY, dtype="float32")
    tokenizer = Tokenizer(TINY)
    prompts = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in PROMPTS]
    copies = LayerCopies(model, "g0")
    remotes = {"r1": RemoteGpu(comm, 1, model.config), "r2": RemoteGpu(comm, 2, model.config)}
    for name, remote in remotes.items():
        copies.add_remote(name, remote)
    last = model.config.num_hidden_layers - 1
    copies.transfer_s = lambda gpu, tokens: 1e-5 * tokens  # modeled: paid where a run of copies begins and ends
    ends = set()
    run = remotes["r1"].start_run

    def logged(layer, rows, items, scatter_s=0.0, gather_s=0.0):
        ends.add((layer, scatter_s > 0, gather_s > 0))
        run(layer, rows, items, scatter_s, gather_s)

    remotes["r1"].start_run = logged

    synced = []

    def before(copies, sequences):  # layers 2-5 replicated on rank 1: half the sequences run there
        moved = sum(copies.replicate(i, "r1") for i in range(2, 6))
        synced.append(remotes["r1"].sync())  # rank 1 says what it holds once it has installed them
        return moved

    def mid(copies, sequences):  # with KV on the ranks: layer 7 to rank 2, layer 3's replica back
        return copies.migrate(last, "g0", "r2", sequences) + copies.evict(3, "r1", sequences)

    def later(copies, sequences):
        return copies.replicate(0, "r2")  # serves the third sequence, admitted after it

    def away(copies, sequences):  # from the ranks: layer 4's replica rank 1 -> 2, the last layer rank 2 -> here
        return copies.migrate(4, "r1", "r2", sequences) + copies.migrate(last, "r2", "g0", sequences)

    outputs, copies, moved = with_copies(model, prompts, {0: before, 2: mid, 1: later, 7: away}, copies)
    same = outputs == reference(model, prompts)
    for remote in remotes.values():
        remote.stop()
    said = {"rank": 0, "same": same, "moved": moved, "hosts": {str(k): v for k, v in copies.hosts.items()},
            "layer_bytes": copies.layer_bytes(1), "ends": sorted(ends), "synced": synced}
    open("%s/rank0.json" % sys.argv[2], "w").write(json.dumps(said))
"""


def test_gpu_ranks_serve_replicas_and_migrated_layers_with_the_same_tokens(tmp_path) -> None:
    """Three real ranks: the instance's (all layers) and two GPU ranks. Replicas on rank 1 before
    admission; mid-generation, the last layer migrates with its KV to rank 2 and a replica on rank 1
    is evicted with its KV coming back; later a replica moves from rank 1 to rank 2 and the last layer
    comes back from rank 2, each with its KV. The greedy tokens are the plain model's."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_mpi_link import LOOPBACK_TCP, MPIEXEC

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable, str(script), str(REPO), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, **LOOPBACK_TCP))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}  # each rank's own file
    assert said[0]["same"]
    hosts = said[0]["hosts"]
    assert hosts["7"] == ["g0"] and hosts["3"] == ["g0"] and hosts["2"] == ["g0", "r1"] and hosts["0"] == ["g0", "r2"]
    assert hosts["4"] == ["g0", "r2"]  # migrated between the ranks mid-generation, and the last layer back here
    assert said[1]["layers"] == [2, 5] and said[2]["layers"] == [0, 4]
    assert said[1]["runs"] > 0 and said[2]["runs"] > 0  # both ranks computed rows
    assert said[0]["moved"][0] == 4 * said[0]["layer_bytes"]  # four replicas' weights
    assert said[0]["synced"] == [[2, 3, 4, 5]]
    # rank 1's copies of layers 2-5, then 2 and 4-5 once layer 3's went, then 2 and 5 once layer 4's
    # moved: the modeled scatter where a run begins, the gather where it ends, nothing in between
    # (layer, scatter paid, gather paid)
    before = {(2, True, False), (3, False, False), (4, False, False), (5, False, True)}
    after = {(2, True, True), (4, True, False), (5, False, True)}
    last = {(2, True, True), (5, True, True)}
    assert {tuple(end) for end in said[0]["ends"]} == before | after | last
