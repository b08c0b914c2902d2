"""Models placed by a device map (accelerate: blocks offloaded to CPU memory or disk and moved in
just in time) and weights in a reduced dtype: every capture, gradient and edit equals the same
run of the model loaded whole, or a forward run by hand in that dtype."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import open_dict

from probe.config import EditSpec
from probe.launch.run import run
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.arrays import h5_arrays
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import make_tiny
from tests.helpers import assert_same_arrays, run_probe

CUDA = pytest.mark.cuda
FAMILIES = {  # the top-level modules of each tiny causal LM and its blocks
    "gpt2": (["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f",
              "lm_head"], "transformer.h"),
    "llama": (["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"],
              "model.layers"),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny GPT-2 and Llama (vocabulary 50, 2 blocks) saved with save_pretrained, and a tokens
    file of 6 random sequences of 8 ids."""
    root = tmp_path_factory.mktemp("placed")
    models = {kind: make_tiny(kind, root / kind, vocab_size=50) for kind in FAMILIES}
    ids = torch.randint(3, 50, (6, 8), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    return models, root / "ids.pt"


def split(kind: str, first_block: str = "disk", rest: str = "cpu") -> str:
    """A device map override: block 0 on `first_block`, everything else on `rest`."""
    top, blocks = FAMILIES[kind]
    places = {name: rest for name in top}
    places[f"{blocks}.0"], places[f"{blocks}.1"] = first_block, rest
    return "model.device_map={" + ",".join(f"{k}:{v}" for k, v in places.items()) + "}"


def model_args(models, kind: str) -> list[str]:
    return ["model=hf", f"model.name={models[kind]}", "model.task=causal_lm"]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_an_offloaded_model_captures_and_differentiates_like_the_whole_one(
    tmp_path, tiny, kind, caplog
):
    """Block 0 and the rest on disk or CPU memory: block outputs and their gradients under
    lm_loss, the model's output and /stats equal the whole model's run, value for value; the
    log says where each selected block runs and where its weights are kept."""
    models, ids = tiny
    args = [
        *model_args(models, kind), "dataset=tokens", f"dataset.path={ids}",
        "dataset.batch_size=4", "probes=residual", "probes.residual.capture=[output,grad_output]",
        "objective=lm_loss",
    ]  # fmt: skip
    whole, _ = run_probe(tmp_path / "whole", *args)
    caplog.set_level(logging.INFO, logger="probe")
    offload = f"model.offload_folder={tmp_path / 'offload'}"
    placed, f = run_probe(tmp_path / "placed", *args, split(kind), offload)
    blocks = FAMILIES[kind][1]
    assert sorted(f["layers"]) == [f"{blocks}.0", f"{blocks}.1"]
    assert any(f"{blocks}.0" in m and "weights kept on disk" in m for m in caplog.messages)
    model = build_model(parse(make_cfg(*args, split(kind), offload)).model, 0)
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert meta and all(n.startswith(f"{blocks}.0.") for n in meta)  # read from disk per call
    assert assert_same_arrays(whole.h5_path, placed.h5_path) >= 8


def test_patch_and_steering_on_offloaded_blocks_equal_the_whole_model(tmp_path, tiny, lm):
    """A patch from the pair into a block on disk and a steering vector added to a block in CPU
    memory: the per-sample effects and the captures equal the whole model's run."""
    models, _ = tiny
    _, pairs_path, _ = lm
    torch.save(torch.linspace(-1, 1, 32), tmp_path / "v.pt")
    edits = {
        "patch": {"layers": ["transformer.h.0"], "op": "patch", "source": "pair", "positions": [2]},
        "steer": {"layers": ["transformer.h.1"], "op": "add", "vector": str(tmp_path / "v.pt")},
    }
    results = {}
    for name, extra in {
        "whole": [],
        "placed": [split("gpt2"), f"model.offload_folder={tmp_path / 'offload'}"],
    }.items():
        cfg = make_cfg(
            *model_args(models, "gpt2"), "dataset=pairs", f"dataset.path={pairs_path}",
            "dataset.batch_size=2", "probes=residual", "probes.residual.rows=samples", *extra,
        )  # fmt: skip
        with open_dict(cfg):
            for edit, spec in edits.items():
                cfg.intervene[edit] = EditSpec(**spec)
            cfg.intervene.metrics = ["logit_diff", "kl"]
        results[name] = run(cfg, run_dir=tmp_path / name)
    assert assert_same_arrays(results["whole"].h5_path, results["placed"].h5_path) >= 6
    effects = [pd.read_csv(results[n].run_dir / "effects.csv") for n in results]
    pd.testing.assert_frame_equal(*effects)
    assert np.abs(effects[0]["edited"] - effects[0]["target"]).max() > 1e-3  # the edits acted


def test_a_torchvision_model_placed_by_a_strategy_within_max_memory(tmp_path, small_resnet):
    """device_map=sequential with 20 MB of CPU memory for resnet18's 45 MB of weights: accelerate
    offloads the later stages to disk, and every capture equals the whole model's."""
    args = [*small_resnet, "probes=all_convs", "probes.convs.layers=[conv1,layer3.*,layer4.1.*]"]
    whole, _ = run_probe(tmp_path / "whole", *args)
    placed, _ = run_probe(
        tmp_path / "placed", *args, "model.device_map=sequential",
        "model.max_memory={cpu:20MB}", f"model.offload_folder={tmp_path / 'offload'}",
    )  # fmt: skip
    assert any(p.suffix == ".dat" for p in (tmp_path / "offload").rglob("*"))  # on disk
    assert assert_same_arrays(whole.h5_path, placed.h5_path) >= 10


@pytest.mark.parametrize("kind", ["hf", "torchvision"])
def test_bfloat16_weights_capture_what_a_bfloat16_forward_gives(tmp_path, tiny, kind):
    """model.dtype=bfloat16: the stored float32 values equal the bfloat16 values of a forward
    run by hand on the same weights cast to bfloat16 (widening is exact)."""
    models, ids = tiny
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        args = [*model_args(models, "gpt2"), "dataset=tokens", f"dataset.path={ids}",
                "probes=residual", "probes.residual.rows=samples"]  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(models["gpt2"], dtype=torch.bfloat16)
        inputs = [torch.load(ids)["input_ids"]]
        names = ["transformer.h.0", "transformer.h.1"]
    else:
        import torchvision

        args = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=4",
                "dataset.batch_size=4", "probes=all_convs", "probes.convs.layers=[conv1,layer4.*]"]  # fmt: skip
        torch.manual_seed(0)
        model = torchvision.models.resnet18().to(torch.bfloat16)
        from probe.data.batches import build_batches

        cfg = make_cfg(*args)
        inputs = [
            b.inputs.to(torch.bfloat16) for b in build_batches(parse(cfg).data, parse(cfg).model, 0)
        ]
        names = ["conv1", "layer4.1.conv2"]
    _, f = run_probe(tmp_path, *args, "model.dtype=bfloat16")
    seen = {n: [] for n in names}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: seen[n].append((o[0] if isinstance(o, tuple) else o).clone())
        )
        for n in names
    ]
    with torch.no_grad():
        for x in inputs:
            model.eval()(x)
    for h in hooks:
        h.remove()
    for n in names:
        want = torch.cat(seen[n]).float().numpy()
        got = f[f"layers/{n}/output"][:]
        assert got.dtype == np.float32 and want.dtype == got.dtype
        np.testing.assert_array_equal(got, want)


def test_param_grad_of_an_offloaded_module_is_refused(tmp_path, tiny):
    models, ids = tiny
    with pytest.raises(Exception, match=r"param_grad of 'transformer.h.0'.*offloaded"):
        run_probe(
            tmp_path, *model_args(models, "gpt2"), "dataset=tokens", f"dataset.path={ids}",
            "probes=residual", "probes.residual.capture=[param_grad]", "objective=lm_loss",
            split("gpt2"), f"model.offload_folder={tmp_path / 'off'}",
        )  # fmt: skip


@pytest.mark.parametrize(
    "args, words",
    [
        (["model.device_map={transformer.h.7:cpu}"], "names 'transformer.h.7', which is no module"),
        (["model.device_map={transformer.h.0:cpu,lm_head:cpu}"], "places no device for"),
        ([split("gpt2")], "offloads to disk but model.offload_folder is not set"),
        (["model.dtype=float8"], "model.dtype='float8' is unknown"),
        (["model.device_map=everywhere"], "model.device_map='everywhere' is unknown"),
        (["model.device_map={lm_head:cuda:7}"], "GPU 'cuda:7'"),
        (["model.offload_folder=/tmp/x"], "model.offload_folder is set but model.device_map"),
    ],
)
def test_bad_placement_is_a_named_error(tmp_path, tiny, args, words, cli_in_process):
    models, ids = tiny
    out = cli_in_process(
        *model_args(models, "gpt2"), "dataset=tokens", f"dataset.path={ids}", "probes=residual",
        *args, f"hydra.run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert words in out.stderr and "Traceback" not in out.stderr


@CUDA
def test_a_model_split_over_cuda_and_cpu_equals_the_whole_model(tmp_path, tiny):
    """Block 0 on the GPU, the rest in CPU memory and run on the GPU (accelerate's rule), against
    the whole model on the GPU: equal captures and gradients."""
    models, ids = tiny
    args = [*model_args(models, "gpt2"), "dataset=tokens", f"dataset.path={ids}",
            "probes=residual", "probes.residual.capture=[output,grad_output]", "objective=lm_loss"]  # fmt: skip
    whole, _ = run_probe(tmp_path / "whole", *args, "device=cuda")
    placed, _ = run_probe(tmp_path / "placed", *args, split("gpt2", "0", "cpu"))
    left, right = h5_arrays(whole.h5_path), h5_arrays(placed.h5_path)
    for name in left:
        if "/scalars" not in name:
            np.testing.assert_allclose(left[name], right[name], rtol=1e-5, atol=1e-6, err_msg=name)


@CUDA
def test_layers_running_on_different_devices_are_read_where_they_run(tmp_path):
    """A model dispatched with blocks that run on the GPU and blocks that run on the CPU (main
    device cpu): probe.run stores what plain hooks on the same dispatched model see."""
    from accelerate import dispatch_model

    import probe

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    ).eval()
    mapping = {"0": 0, "1": 0, "2": "cpu", "3": 0}
    model = dispatch_model(model, mapping, main_device="cpu")
    model.hf_device_map = mapping
    x = torch.randn(12, 8)
    seen, devices = {}, {}

    def keep(name):
        def hook(m, a, o):
            seen.setdefault(name, []).append(o.detach().float().cpu())
            devices[name] = o.device.type

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in ("0", "2", "3")]
    with torch.no_grad():
        for chunk in x.split(4):
            model(chunk)
    for h in handles:
        h.remove()
    assert devices == {"0": "cuda", "2": "cpu", "3": "cuda"}
    run = probe.run(model, list(x.split(4)), {"lin": {"layers": ["0", "2", "3"]}}, out=tmp_path)
    with run:
        for name in ("0", "2", "3"):
            got = np.asarray(run.array(name, "output"))
            np.testing.assert_array_equal(got, torch.cat(seen[name]).numpy())
