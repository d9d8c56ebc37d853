"""The plain baseline of the start-up benchmark: the script a user writes for torchrun, with
nothing but torch and scikit-learn. Same work as `train`'s default experiment: the small CNN on
scikit-learn's digits, 2 ranks, batch 32 per rank, SGD. Rank 0 prints `step=1` right after
the first optimizer step (the moment the benchmark times), then the script ends.

    torchrun --nproc_per_node=2 benchmarks/plain_torchrun.py
"""

import os
import sys

import torch

# DDP's constructor imports torch._dynamo anyway. Imported there, after gloo's threads have
# started, rank 1 aborted at exit ("terminate called without an active exception") in plain
# PyTorch 2.13 too, so the baseline imports it first, as framework/rank/build.py does.
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from plain_loop_torchrun import SmallCNN  # beside this script: the same layers
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    digits = load_digits()
    images = (torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    data = TensorDataset(images, torch.tensor(digits.target))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data), drop_last=True)
    model = SmallCNN(in_channels=1)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    inputs, targets = next(iter(loader))
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step=1 loss={loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    # torch 2.13 can deadlock when the DDP model is freed (here, as main returns): the main
    # thread joins gloo's worker thread holding the GIL while that thread waits for the GIL to
    # drop a finished work item (py-spy --native: ~ProcessGroupGloo in std::thread::join). Seen
    # in 3 of 8 runs. `train`'s local ranks, processes of multiprocessing, end with os._exit too.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
