"""Lightning on the "ringcomm" backend: a LightningModule on scikit-learn's digits, DDP with
metrics synchronised across ranks (sync_dist=True: Lightning all-reduces int64 counts with AVG).

    torchrun --nproc-per-node 2 examples/lightning_digits.py ringcomm    # or gloo, to compare
"""

import argparse

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
parser.add_argument(
    "backend",
    nargs="?",
    default="ringcomm",
    help="process_group_backend of Lightning's DDPStrategy (default: %(default)s)",
)
backend = parser.parse_args().backend

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import ringcomm  # noqa: F401  registers the backend

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16
y = torch.tensor(digits.target)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
train, val = order[:1500], order[1500:]


class Digits(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def training_step(self, batch, _):
        inputs, labels = batch
        loss = F.cross_entropy(self.net(inputs), labels)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        inputs, labels = batch
        self.log("val_acc", (self.net(inputs).argmax(1) == labels).float().mean(), sync_dist=True)
        self.log("val_count", torch.tensor(len(labels)), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    max_epochs=4,
    logger=False,
    strategy=DDPStrategy(process_group_backend=backend),
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)
trainer.fit(
    Digits(),
    DataLoader(TensorDataset(x[train], y[train]), batch_size=32),
    DataLoader(TensorDataset(x[val], y[val]), batch_size=64),
)
import torch.distributed as dist

print(
    f"RESULT backend={dist.get_backend()} rank={trainer.global_rank} "
    f"val_acc={float(trainer.callback_metrics['val_acc']):.4f}",
    flush=True,
)
# Lightning leaves the process group up. Without this, gloo's worker threads can outlive the
# interpreter's teardown and abort the process ("terminate called without an active exception":
# pytorch/pytorch#190489), which failed this example's gloo run once in CI.
dist.destroy_process_group()
