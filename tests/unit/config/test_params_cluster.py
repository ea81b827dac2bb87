"""cluster.* params: validated like every param, local is today's behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import PARAMS_YAML, params_file

from eagle3_pipeline.config.params import load_params
from eagle3_pipeline.config.training_params import ClusterParams
from eagle3_pipeline.core.errors import ParamsError


def test_default_is_local_on_one_node() -> None:
    c = ClusterParams()
    assert (c.engine, c.nodes, c.training_nodes) == ("local", 1, 1)


def test_train_nodes_default_to_nodes() -> None:
    assert ClusterParams(engine="ray", nodes=3).training_nodes == 3
    assert ClusterParams(engine="ray", nodes=2, train_nodes=4).training_nodes == 4


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"nodes": 2}, "field 'cluster': cluster.nodes=2 needs cluster.engine: ray"),
        ({"train_nodes": 2}, "cluster.train_nodes=2 needs cluster.engine: ray"),
        ({"engine": "slurm"}, "field 'cluster.engine'"),
        ({"engine": "ray", "nodes": 0}, "field 'cluster.nodes'"),
        ({"engine": "ray", "node": 2}, "unknown key 'cluster.node'"),
    ],
)
def test_bad_cluster_params_one_line(tmp_path: Path, cluster: dict, message: str) -> None:
    with pytest.raises(ParamsError) as err:
        load_params(params_file(tmp_path / "params.yaml", PARAMS_YAML, cluster=cluster))
    assert message in str(err.value)
    assert "\n" not in str(err.value)
