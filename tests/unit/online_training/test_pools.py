"""Online training across nodes: the pool split, its refusal, and the trainers' placement."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import make_params, pretrained

from eagle3_pipeline.cluster import engine, torchrun
from eagle3_pipeline.config.params import Params
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import ParamsError
from eagle3_pipeline.in_vllm import entry_points
from eagle3_pipeline.online_training import pools as cluster_online
from eagle3_pipeline.online_training import source as online
from eagle3_pipeline.online_training.source import OnlineSource
from eagle3_pipeline.verifier.identity import VerifierFacts

A = engine.Node("a" * 56, "10.0.0.1")
B = engine.Node("b" * 56, "10.0.0.2")
C = engine.Node("c" * 56, "10.0.0.3")
ARGS = ["--worker", "/ws/data/.work/train/params.json"]


def test_first_nodes_serve_the_rest_train() -> None:
    c = ClusterParams(engine="ray", nodes=3, train_nodes=2)
    assert cluster_online.split_pools([A, B, C], c) == ([A], [B, C])
    c = ClusterParams(engine="ray", nodes=3, train_nodes=1)
    assert cluster_online.split_pools([A, B, C], c) == ([A, B], [C])


@pytest.mark.parametrize(("nodes", "train_nodes"), [(2, None), (2, 2), (1, None), (2, 3)])
def test_no_inference_node_is_refused_with_the_fix(nodes: int, train_nodes: int | None) -> None:
    c = ClusterParams(engine="ray", nodes=nodes, train_nodes=train_nodes)
    with pytest.raises(ParamsError) as err:
        cluster_online.inference_count(c)
    line = str(err.value)
    assert "\n" not in line
    assert "params.yaml: cluster.train_nodes=" in line and "set cluster.train_nodes below" in line


@pytest.mark.parametrize(
    ("mooncake", "num_gpus", "env", "serving"),
    [
        (False, 0, {}, [A, B]),  # files: every inference node
        (False, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, [A, B]),
        (True, 0, {}, [A, B]),  # CPU servers, the worker inside the engine core: both
        (True, 0, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, [A, B]),
        (True, 0, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, [A]),  # a worker process: the first
        (True, 1, {}, [A]),  # GPU servers: not shown yet
    ],
)
def test_mooncake_serves_from_every_inference_node_only_where_shown_to_work(
    mooncake: bool, num_gpus: float, env: dict[str, str], serving: list[engine.Node]
) -> None:
    assert cluster_online.serving_nodes([A, B], mooncake, num_gpus, env) == serving


# Online training on a 2-node Ray cluster: one node serves, one trains.
ONLINE_RAY = {
    "verifier": pretrained("data/verifier"),
    "cluster": {"engine": "ray", "nodes": 2, "train_nodes": 1},
    "train": {"hidden_states": "online"},
}


# The verifier as the stage read it; these tests never load it (the server spec is faked).
FACTS = VerifierFacts("data/verifier", None, None, False, {}, "")


def _online_source(params: Params, work: Path):
    return online.online_source(params.train.online, FACTS, params.vllm, [1, 2], work)


def _uses_pools(params: Params) -> bool:
    return cluster_online.uses_pools(params.train, params.cluster)


def test_pools_only_when_this_stage_starts_the_server_on_a_ray_cluster() -> None:
    assert _uses_pools(make_params(ONLINE_RAY))
    assert not _uses_pools(
        make_params(ONLINE_RAY, train={"online": {"endpoint": "http://h:8000/v1"}})
    )
    assert not _uses_pools(make_params(ONLINE_RAY, train={"hidden_states": "store"}))
    local = make_params(ONLINE_RAY).model_copy(update={"cluster": ClusterParams()})
    assert not _uses_pools(local)


def test_mooncake_server_config_names_the_node_and_master() -> None:
    params = make_params(ONLINE_RAY, train={"online": {"backend": "mooncake"}})
    kv = cluster_online.mooncake_kv_config(
        params.train.online.mooncake, "10.0.0.1:50051", "10.0.0.1"
    )
    assert kv["kv_connector"] == "CPUMooncakeHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == entry_points.MOONCAKE_CONNECTOR
    mooncake = kv["kv_connector_extra_config"]["mooncake"]
    assert mooncake["master_server_address"] == "10.0.0.1:50051"
    assert mooncake["local_hostname"] == "10.0.0.1"


def test_trainers_run_on_the_training_pool_with_their_own_mooncake_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    submitted: list[tuple[str, dict]] = []

    def choose(c, exclude=frozenset(), count=None):
        return [n for n in (A, B, C) if n.node_id not in exclude][:count]

    def submit(node, argv, c, env=None, bind_collectives=False):
        assert bind_collectives
        submitted.append((node.label, env or {}))
        return node.label

    monkeypatch.setattr(engine, "choose_nodes", choose)
    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "outcome", lambda node, ref: engine.Outcome(node, 0))
    monkeypatch.setattr(torchrun, "_wait", lambda refs, timeout: [refs[0]] if refs else [])
    source = OnlineSource("http://10.0.0.1:8000/v1", "x", "run-key")
    assert "run-key" not in repr(source)
    pools = cluster_online.Pools([source], [A], [B, C], "m")
    c = ClusterParams(engine="ray", nodes=3, train_nodes=2)
    record = torchrun.run_across_nodes(
        c, 1, "eagle3_pipeline.stages.train", ARGS,
        exclude=frozenset({A.node_id}), env_for=pools.trainer_env,
    )  # fmt: skip
    assert record["nodes"] == [B.label, C.label]
    # the server's key (speculators' client sends it) and the servers, one per rank
    key = {"EAGLE3_VLLM_API_KEY": "run-key", "EAGLE3_ONLINE_ENDPOINTS": source.endpoint}
    assert submitted == [
        (B.label, key | {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.2"}),
        (C.label, key | {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.3"}),
    ]
    no_master = cluster_online.Pools([pools.source], [A], [B, C], None)
    assert no_master.trainer_env(B) == key
    keyless = cluster_online.Pools([OnlineSource("http://10.0.0.1:8000/v1", "x")], [A], [B], None)
    assert keyless.trainer_env(B) == {"EAGLE3_ONLINE_ENDPOINTS": "http://10.0.0.1:8000/v1"}


def test_a_master_in_params_is_used_else_one_is_started() -> None:
    assert (
        cluster_online.given_master(
            make_params(ONLINE_RAY, train={"online": {"backend": "mooncake"}}).train.online
        )
        is None
    )
    given = make_params(
        ONLINE_RAY,
        train={"online": {"backend": "mooncake", "mooncake": {"master": "10.0.0.9:50051"}}},
    )
    assert cluster_online.given_master(given.train.online) == "10.0.0.9:50051"


def test_a_server_this_stage_starts_wants_the_run_s_own_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Single node (online_training/source.py) as across nodes: the run's key on the server, in the
    source the trainers get, nowhere in its name (which logs and errors print)."""
    import contextlib
    import types

    from eagle3_pipeline.serving import hidden_states, server

    specs = []

    @contextlib.contextmanager
    def serve(spec, on_down=None):
        specs.append(spec)
        yield "http://127.0.0.1:8123"

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.setattr(hidden_states, "clear_dir", lambda path: None)
    monkeypatch.setattr(
        hidden_states, "hidden_state_spec", lambda *a: types.SimpleNamespace(api_key=None)
    )
    keys = []
    for _ in range(2):
        with _online_source(make_params(ONLINE_RAY), tmp_path) as source:
            assert source.api_key and source.api_key == specs[-1].api_key
            assert source.api_key not in source.name + repr(source)
            assert online.trainer_env(source) == {"EAGLE3_VLLM_API_KEY": source.api_key}
            keys.append(source.api_key)
    assert keys[0] != keys[1] and len(keys[0]) >= 32  # per run
    given = make_params(ONLINE_RAY, train={"online": {"endpoint": "http://h:8000/v1"}})
    monkeypatch.delenv("EAGLE3_VLLM_API_KEY", raising=False)
    with _online_source(given, tmp_path) as source:
        assert source.api_key is None and online.trainer_env(source) == {}
    monkeypatch.setenv("EAGLE3_VLLM_API_KEY", "users-key")
    with _online_source(given, tmp_path) as source:
        assert source.api_key == "users-key"


def test_each_rank_takes_one_server_of_the_pool_round_robin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """speculators' dataloader takes one endpoint: ranks spread over the inference pool's
    servers by global rank (so two ranks of one node use two servers)."""
    from eagle3_pipeline.online_training import source as online

    servers = [OnlineSource(f"http://10.0.0.{i}:8000/v1", f"s{i}", "k") for i in (1, 2)]
    pools = cluster_online.Pools(servers, [A, B], [C], None)
    for name, value in pools.trainer_env(C).items():
        monkeypatch.setenv(name, value)
    chosen = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        chosen.append(online.endpoint_for_rank("http://params/v1"))
    assert chosen == [s.endpoint for s in servers] * 2
    monkeypatch.delenv(online.ENDPOINTS_VAR)
    assert online.endpoint_for_rank("http://params/v1") == "http://params/v1"  # no pool


def test_a_server_found_gone_is_left_to_the_others_and_the_last_one_ends_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from eagle3_pipeline.core.errors import ServerError

    servers = [OnlineSource(f"http://10.0.0.{i}:8000/v1", f"s{i}", "k") for i in (1, 2)]
    gone = {0: False, 1: False}
    record = {"vllm": [{"node": A.label}, {"node": B.label}]}
    watchers = [lambda: gone[0], lambda: gone[1]]
    pools = cluster_online.Pools(servers, [A, B], [C], None, record, watchers)
    monkeypatch.setattr(cluster_online, "_healthy", lambda source: True)
    assert pools.newly_lost() == []
    gone[1] = True  # its worker ended (its node died)
    assert pools.newly_lost() == [B.label]
    assert pools.newly_lost() == []  # named once
    assert record["vllm"][1]["lost"] is True and "lost" not in record["vllm"][0]
    assert pools.trainer_env(C)["EAGLE3_ONLINE_ENDPOINTS"] == servers[0].endpoint
    monkeypatch.setattr(cluster_online, "_healthy", lambda source: False)  # /health is down
    with pytest.raises(ServerError, match="every inference server was lost") as err:
        pools.newly_lost()
    assert "\n" not in str(err.value) and A.label in str(err.value)


def test_the_master_s_node_lost_ends_the_run_naming_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from eagle3_pipeline.core.errors import ServerError

    servers = [OnlineSource(f"http://10.0.0.{i}:8000/v1", f"s{i}", "k") for i in (1, 2)]
    record = {"vllm": [{"node": A.label}, {"node": B.label}], "mooncake_master": {"node": A.label}}
    pools = cluster_online.Pools(servers, [A, B], [C], "10.0.0.1:50051", record, [])
    monkeypatch.setattr(cluster_online, "_healthy", lambda source: source is not servers[0])
    with pytest.raises(ServerError, match="Mooncake master") as err:
        pools.newly_lost()
    assert "train.online.mooncake.master" in str(err.value)
    given = {**record, "mooncake_master": {"address": "10.0.0.9:50051", "given": True}}
    pools = cluster_online.Pools(servers, [A, B], [C], "10.0.0.9:50051", given, [])
    assert pools.newly_lost() == [A.label]  # a master of the user's own: the other server goes on
