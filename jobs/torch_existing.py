"""A plain single-process PyTorch training script (an MLP on the handwritten digits).

docs/TORCH.md ("PyTorch models: mpidist.torch") shows the diff that makes it data parallel with
mpidist.torch: a DistributedOptimizer around the torch optimizer (the scheduler takes it),
synchronize() before the gradients are clipped, and each rank reading its shard of every
batch.

    python jobs/torch_existing.py
"""
import torch
from sklearn.datasets import load_digits


def main(epochs: int = 20, batch: int = 128) -> float:
    digits = load_digits()
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(len(digits.target), generator=g)
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target)[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for epoch in range(epochs):
        for i in range(0, len(x_train) - batch + 1, batch):
            xb, yb = x_train[i:i + batch], y_train[i:i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        scheduler.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"test accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
