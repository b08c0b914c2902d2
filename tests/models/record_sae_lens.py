"""Records SAELens's own reading of the SAE folders that tests/models/test_sae_loading.py writes:
for each architecture and `apply_b_dec_to_input`, the weights, the inputs, and what SAELens's
`SAE.load_from_disk(folder)` gives for `encode(inputs)` and `decode` of those latents, into
sae_lens_values.npz beside this file. The test compares probe's loading with these values, so it
runs where SAELens is not installed (SAELens pins TransformerLens below 4 and brings some 45
packages). Rewrite the file with `python -m tests.models.record_sae_lens` where sae_lens is
installed; the test also compares a live SAELens with it there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from tests.models.test_sae_loading import ARCHITECTURES, inputs, weights, write_sae

VALUES = Path(__file__).with_name("sae_lens_values.npz")


def sae_lens_reads(folder: Path, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """SAELens's latents of `x` and its reconstruction from them, for the SAE in `folder`."""
    import sae_lens

    sae = sae_lens.SAE.load_from_disk(str(folder))
    with torch.no_grad():
        z = sae.encode(x)
        return z.numpy(), sae.decode(z).numpy()


def record(path: Path = VALUES) -> None:
    import sae_lens

    x = inputs()
    found = {"inputs": x.numpy(), "sae_lens_version": np.array(sae_lens.__version__)}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            for name, t in weights(arch).items():
                found[f"{arch}/{name}"] = t.numpy()
            for apply_b_dec in (True, False):
                folder = Path(tmp) / f"{arch}-{apply_b_dec}"
                write_sae(folder, arch, apply_b_dec_to_input=apply_b_dec)
                z, recon = sae_lens_reads(folder, x)
                found[f"{arch}/{apply_b_dec}/z"], found[f"{arch}/{apply_b_dec}/recon"] = z, recon
    np.savez_compressed(path, **found)


if __name__ == "__main__":
    record()
    print(f"wrote {VALUES}")
