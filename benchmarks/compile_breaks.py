"""Where a DiT-XL layer's compiled graph breaks on this device (bf16)."""
import warnings; warnings.filterwarnings("ignore")
import torch, torch._dynamo
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.initialize import initialize_distributed
initialize_distributed(ParallelConfig(), 0)
from dit_mcore.config import preset
from dit_mcore.models import build_model
from dit_mcore.models.layer_stack import _quiet_default_tp_group
from dit_mcore.models.modulation import Conditioning
_quiet_default_tp_group()
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
cfg = preset("DiT-S/2")
layer = build_model(cfg).layers[0].to(dev, dt)
h = torch.randn(256, 4, cfg.hidden_size, device=dev, dtype=dt, requires_grad=True)
c = Conditioning(torch.randn(4, cfg.hidden_size, device=dev, dtype=dt))
e = torch._dynamo.explain(layer)(h, c)
print("graphs", e.graph_count, "breaks", e.graph_break_count)
for b in e.break_reasons:
    fr = b.user_stack[-1] if b.user_stack else None
    print(" -", str(b.reason)[:300].replace("\n", " "), "@", fr.filename.split("site-packages/")[-1] if fr else "", fr.lineno if fr else "")
