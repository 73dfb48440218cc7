"""The built-in GPT trains end to end on the synthetic corpus with a pipeline schedule."""

from __future__ import annotations

import math

import pytest
import torch

from zerobubble_demo import ConfigError
from zerobubble_demo.models import GPTConfig, MarkovCorpus, gpt_layers, lm_loss
from zerobubble_demo.train import TrainConfig, print_summary, run_training


def test_corpus_is_seeded_and_shifted():
    first, second = MarkovCorpus(16, 8, seed=3), MarkovCorpus(16, 8, seed=3)
    inputs, targets = first.batch(4)
    again, _ = second.batch(4)
    assert torch.equal(inputs, again)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    successors = {(int(a), int(b)) for a, b in zip(inputs.flatten(), targets.flatten())}
    assert all(b in first.successors[a].tolist() for a, b in successors)


def test_gpt_layers_start_at_chance_level():
    config = GPTConfig(vocab=32, seq_len=8, dim=16, heads=2, n_layers=2)
    layers = gpt_layers(config)
    assert len(layers) == config.n_layers + 2
    tokens = torch.randint(32, (4, 8))
    values = tokens
    for layer in layers:
        values = layer(values)
    assert values.shape == (4, 8, 32)
    assert abs(lm_loss(values, tokens).item() - math.log(32)) < 1.0


@pytest.mark.multiprocess
def test_run_training_spawns_ranks_and_the_loss_drops():
    config = TrainConfig(
        schedule="zb-v",
        ranks=2,
        steps=25,
        microbatches=4,
        batch_size=16,
        seq_len=16,
        vocab=32,
        dim=32,
        heads=2,
        layers=2,
        lr=1e-2,
        progress=False,
        timeout=60,
    )
    summary = run_training(config)
    assert summary.schedule == "zb-v" and summary.ranks == 2 and len(summary.losses) == 25
    assert summary.first_loss == pytest.approx(summary.losses[0])
    assert summary.first_loss > math.log(32) - 0.5
    assert summary.last_loss < summary.first_loss - 1.0, summary.losses
    assert 0.0 <= summary.predicted_bubble < 1.0 and summary.step_time > 0
    assert summary.steps_skipped == 0 and 0 <= summary.steps_rolled_back <= summary.steps
    assert any("rolled back" in line for line in summary.lines())


@pytest.mark.multiprocess
def test_data_parallel_training_clips_and_reports_the_optimizer_outcomes():
    config = TrainConfig(
        schedule="zb-v",
        ranks=2,
        data_parallel=2,
        steps=12,
        microbatches=2,
        batch_size=8,
        seq_len=8,
        vocab=16,
        dim=16,
        heads=2,
        layers=2,
        lr=1e-2,
        max_norm=0.05,
        progress=False,
        timeout=60,
    )
    summary = run_training(config)
    assert summary.ranks == 2 and summary.data_parallel == 2 and len(summary.losses) == 12
    assert summary.steps_clipped == 12, "a tiny max_norm clips every step"
    assert summary.steps_skipped == 0
    assert "2 data-parallel replicas" in summary.lines()[0]
    assert "clipped 12" in summary.lines()[-1]


def test_train_config_rejects_a_data_parallel_size_that_does_not_divide_the_ranks():
    with pytest.raises(ConfigError, match="does not divide ranks=3"):
        run_training(TrainConfig(ranks=3, data_parallel=2, progress=False))
    with pytest.raises(ConfigError, match="2 replicas"):
        run_training(TrainConfig(ranks=2, data_parallel=2, batch_size=12, microbatches=4, progress=False))


def test_training_on_a_mesh_with_fsdp_along_dp():
    summary = run_training(
        TrainConfig(
            mesh="pp=2,dp=2", data_parallel="fsdp", steps=6, microbatches=2, batch_size=8, progress=False
        )
    )
    assert summary.ranks == 4 and summary.data_parallel == 2
    assert "(mesh pp 2 × dp 2, fsdp)" in summary.lines()[0]
    assert summary.last_loss < summary.first_loss


@pytest.mark.slow
def test_training_with_tensor_parallel_blocks():
    """``--mesh pp=2,tp=2``: the blocks split Megatron-style (separate q, k, v), one rank reporting."""
    config = TrainConfig(mesh="pp=2,tp=2", steps=6, microbatches=2, batch_size=8, progress=False)
    assert not config.model.fused_qkv and config.replicas == 1
    summary = run_training(config)
    assert summary.ranks == 4 and "(mesh pp 2 × tp 2)" in summary.lines()[0]
    assert summary.last_loss < summary.first_loss


@pytest.mark.slow
def test_training_compiled_blocks_keeps_learning():
    """``zerobubble train --compile aot_eager``: every block compiled, the linears split inside."""
    summary = run_training(
        TrainConfig(schedule="zb-h1", compile="aot_eager", steps=4, layers=2, microbatches=2, progress=False)
    )
    assert summary.last_loss < summary.first_loss


def test_a_mesh_sets_the_ranks_replicas_and_pipeline_size():
    config = TrainConfig(mesh="pp=2,dp=3", data_parallel="fsdp", batch_size=12, microbatches=2)
    assert (config.world, config.replicas, config.pipeline_ranks) == (6, 3, 2)
    hsdp = TrainConfig(mesh="pp=2,dp_replicate=2,dp_shard=2,tp=2", data_parallel="hsdp")
    assert (hsdp.world, hsdp.replicas, hsdp.pipeline_ranks) == (16, 4, 2)
    assert TrainConfig().world == 2 and TrainConfig(ranks=4, data_parallel=2).pipeline_ranks == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mesh": "dp=2"}, "has no pp dimension"),
        ({"mesh": "pp=2,pp=2"}, "write each dimension once as name=size"),
        ({"mesh": "pp=two"}, "write each dimension once"),
        ({"mesh": "pp=2,cp=2"}, "unknown dimensions ['cp']"),
        ({"mesh": "pp=2,tp=3"}, "tp=3 must divide the heads (4) and the width (64)"),
        ({"mesh": "pp=2,dp=2", "data_parallel": "hsdp"}, "lacks them (e.g. pp=2,dp_replicate=2,dp_shard=2)"),
        ({"mesh": "pp=2,dp=2", "ranks": 2}, "ranks=2 but the mesh 'pp=2,dp=2' has 4 ranks"),
        ({"mesh": "pp=2", "data_parallel": "fsdp"}, "has none"),
        ({"mesh": "pp=2,dp=2", "data_parallel": 3}, "replicate, fsdp (along dp) or hsdp"),
        ({"data_parallel": "fsdp"}, "add --mesh pp=P,dp=D"),
    ],
)
def test_train_config_rejects_a_mesh_that_cannot_train(settings, message):
    with pytest.raises(ConfigError) as error:
        run_training(TrainConfig(progress=False, **settings))
    assert message in str(error.value)


def test_print_summary_leaves_the_process_group_to_whoever_created_it(tmp_path, capsys):
    """A caller that set up torch.distributed keeps its group after printing (rank 0 prints)."""
    import torch.distributed as dist

    from zerobubble_demo.train import TrainSummary

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summary = TrainSummary(
            schedule="1f1b", ranks=1, microbatches=2, steps=1, first_loss=1.0, last_loss=1.0, step_time=1.0,
            tokens_per_second=1.0, predicted_bubble=0.0, entropy_floor=0.5, losses=[1.0],
        )  # fmt: skip
        print_summary(summary)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert "1f1b" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path):
    """``train --steps 4 --save d`` then ``--resume d --steps 2`` gives the losses of ``--steps 6``
    (resuming into other layouts: tests/runtime/state/test_dcp.py)."""
    from zerobubble.cli import build_parser

    def config(*flags: str) -> TrainConfig:
        base = (
            "--ranks 2 --microbatches 2 --batch-size 8 --seq-len 8 --vocab 16 --dim 16 --heads 2 --layers 2"
        )
        args = vars(build_parser().parse_args(["train", *base.split(), "--no-progress", *flags]))
        given = {key: value for key, value in args.items() if value is not None}
        return TrainConfig(**{key: given[key] for key in TrainConfig.__dataclass_fields__ if key in given})

    saved = str(tmp_path / "ckpt")
    whole = run_training(config("--steps", "6"))
    first = run_training(config("--steps", "4", "--save", saved))
    second = run_training(config("--steps", "2", "--resume", saved))
    assert first.losses == pytest.approx(whole.losses[:4], rel=1e-6)
    assert second.first_step == 4 and "resumed after step 4" in second.lines()[0]
    assert second.losses == pytest.approx(whole.losses[4:], rel=1e-6)
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        run_training(config("--steps", "2", "--resume", str(tmp_path / "nothing")))
