"""Trains a tiny ResNet on CPU through a shardd daemon, checkpoints the model and the data
position, and after a kill resumes exactly where the checkpoint was: the samples it trains on,
run after run, are those of an uninterrupted run, in the same order.

    python examples/make_tiny_dataset.py /tmp/tiny      # shards + manifest; prints config lines
    shardd serve --config shardd.toml &                 # with those [datasets.tiny] lines
    python examples/train_resnet_tiny.py --socket /run/shardd/shardd.sock --dataset tiny \\
        --checkpoint /tmp/tiny.ckpt --log /tmp/tiny.log
    # kill -9 it at any time and run the same command again: it resumes from the checkpoint

Any dataset of images (`png` or `jpg`) with a `cls` label works (`--classes`). `--loader
stateful` (default) checkpoints torchdata's StatefulDataLoader state; `--loader plain` uses
torch's DataLoader and resumes from the step count with ShardDataset.skip. `--log` records
every sample trained on ("epoch step key"); on resume it is cut back to the checkpoint, so
it always holds exactly what the model saw. `--kill-at-step N` sends SIGKILL to itself (and
its DataLoader workers) after step N, for tests.

Needs torch, webdataset, Pillow (PNG/JPEG decoding) and, for `--loader stateful`, torchdata:
`pip install "clients/python[stateful]" webdataset pillow`.
"""

import argparse
import functools
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import webdataset as wds

import shardd.torch as st

def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default=os.environ.get("SHARDD_SOCKET", st.DEFAULT_SOCKET))
    p.add_argument("--dataset", default="tiny")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16, help="images are resized to this")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--loader", choices=["stateful", "plain"], default="stateful")
    p.add_argument("--checkpoint", default="tiny-resnet.ckpt")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps")
    p.add_argument("--log", default=None, help="append 'epoch step key' per sample trained on")
    p.add_argument("--final", default=None, help="save the trained weights here at the end")
    p.add_argument("--kill-at-step", type=int, default=None)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class TinyResNet(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def prepare(sample, size):
    """(key, CHW float image of any size, label) -> (key, 3 x size x size image, label)."""
    key, image, label = sample
    if image.shape[-2:] != (size, size):
        image = F.interpolate(image[None], size=(size, size), mode="bilinear", align_corners=False)[0]
    return key, image, int(label)


def save_checkpoint(path, **state):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill never leaves half a checkpoint


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # bitwise-reproducible CPU training, run after run

    # The two lines that replace wds.WebDataset(urls): the daemon reads, shuffles and splits
    # the shards; webdataset's stages decode in each DataLoader worker, as before.
    dataset = st.ShardDataset(args.dataset, socket=args.socket, seed=args.seed)
    dataset.compose(wds.decode("torchrgb"), wds.to_tuple("__key__", "png;jpg;jpeg", "cls"), wds.map(functools.partial(prepare, size=args.image_size)))
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)

    model = TinyResNet(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch, start_step, global_step, log_bytes = 0, 0, 0, 0
    if os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, start_step, global_step = ckpt["epoch"], ckpt["step"], ckpt["global_step"]
        log_bytes = ckpt["log_bytes"]
        if args.loader == "stateful":
            loader.load_state_dict(ckpt["loader"])
        print(f"resuming at epoch {start_epoch}, step {start_step}", flush=True)
    log = None
    if args.log:
        log = open(args.log, "a+")
        log.truncate(log_bytes)  # steps trained after the checkpoint are trained again
        log.seek(log_bytes)

    for epoch in range(start_epoch, args.epochs):
        dataset.set_epoch(epoch)
        step = start_step if epoch == start_epoch else 0
        if args.loader == "plain" and step:
            dataset.skip(batches=step, batch_size=args.batch_size)
        began, seen, total = time.monotonic(), 0, 0.0
        for keys, images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            global_step += 1
            seen += len(keys)
            total += loss.item() * len(keys)
            if log:
                log.write("".join(f"{epoch} {step - 1} {k}\n" for k in keys))
                log.flush()
            if global_step % args.checkpoint_every == 0:
                extra = {"loader": loader.state_dict()} if args.loader == "stateful" else {}
                save_checkpoint(args.checkpoint, model=model.state_dict(), optimizer=optimizer.state_dict(),
                                epoch=epoch, step=step, global_step=global_step,
                                log_bytes=log.tell() if log else 0, **extra)
            if global_step == args.kill_at_step:
                print(f"killing myself after step {global_step}", flush=True)
                own_group = os.getpgrp() == os.getpid()
                os.killpg(os.getpgrp(), signal.SIGKILL) if own_group else os.kill(os.getpid(), signal.SIGKILL)
        if seen:
            print(f"epoch {epoch}: {seen} samples, {step} steps, loss {total / seen:.4f}, "
                  f"{seen / (time.monotonic() - began):.0f} samples/s", flush=True)
    if args.final:
        torch.save(model.state_dict(), args.final)


if __name__ == "__main__":
    main()
