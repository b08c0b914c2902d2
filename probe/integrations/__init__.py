"""probe.watch driven by a trainer's callbacks: `probe.integrations.lightning.ProbeCallback`
for Lightning's Trainer, `probe.integrations.hf.ProbeCallback` for transformers' Trainer (each
imports its trainer; `pip install 'probe[lightning]'` or `'probe[hf]'`)."""
