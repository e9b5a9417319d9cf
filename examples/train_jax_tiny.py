"""Trains a tiny JAX model on CPU from a shardd daemon through Grain, checkpoints the model and
the data iterator with orbax, and after a kill resumes exactly where the checkpoint was: the
samples it trains on, run after run, are those of an uninterrupted run, in the same order, and
the final parameters are the same bit for bit.

    python examples/make_tiny_dataset.py /tmp/tiny      # shards + manifest; prints config lines
    shardd serve --config shardd.toml &                 # with those [datasets.tiny] lines
    python examples/train_jax_tiny.py --socket /run/shardd/shardd.sock --dataset tiny \\
        --checkpoint /tmp/tiny-jax --log /tmp/tiny-jax.log
    # kill -9 it at any time and run the same command again: it resumes from the checkpoint

The pipeline is a Grain one: ``shardd.grain.ShardDataset(...).map(decode).batch(n)``; its
iterator is saved with Grain's orbax handler (``grain.checkpoint.CheckpointSave``) next to
the parameters and the optimizer state (``ocp.args.StandardSave``), in one orbax step.
``--log`` records every sample trained on ("step key"); on resume it is cut back to the
checkpoint, so it always holds exactly what the model saw. ``--kill-at-step N`` sends SIGKILL
to itself after step N, for tests. ``--final`` writes the trained parameters (``.npz``).

Needs jax (CPU is enough), grain, orbax-checkpoint, numpy and Pillow:
`pip install "shardd[grain]" orbax-checkpoint pillow`.
"""

import os

# One thread for XLA's CPU kernels: bitwise-reproducible training, run after run.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from PIL import Image  # noqa: E402

import shardd.grain  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default=os.environ.get("SHARDD_SOCKET", shardd.grain.DEFAULT_SOCKET))
    p.add_argument("--dataset", default="tiny")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--streams", type=int, default=2, help="daemon streams read in threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", default="tiny-jax-ckpt", help="an orbax checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps")
    p.add_argument("--log", default=None, help="append 'step key' per sample trained on")
    p.add_argument("--final", default=None, help="save the trained parameters here (.npz)")
    p.add_argument("--kill-at-step", type=int, default=None)
    return p.parse_args()


def decode(size):
    def f(sample):
        image = Image.open(io.BytesIO(sample["png"])).convert("RGB")
        if image.size != (size, size):
            image = image.resize((size, size), Image.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        # Keys as fixed-width bytes: a batch of them is a numpy array like the rest.
        return {"key": np.asarray(sample["__key__"].encode()), "image": pixels,
                "label": np.int32(int(sample["cls"]))}
    return f


def init_params(key, size, classes, hidden=64):
    k1, k2 = jax.random.split(key)
    n = size * size * 3
    return {
        "w1": jax.random.normal(k1, (n, hidden), jnp.float32) * (1.0 / np.sqrt(n)),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, classes), jnp.float32) * (1.0 / np.sqrt(hidden)),
        "b2": jnp.zeros((classes,), jnp.float32),
    }


def loss_fn(params, images, labels):
    x = images.reshape(images.shape[0], -1)
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def make_step(lr, momentum=0.9):
    @jax.jit
    def step(state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], images, labels)
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, state["velocity"], grads)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, state["params"], velocity)
        return {"params": params, "velocity": velocity}, loss
    return step


def main():
    args = parse_args()
    # The data: a rank's share of the dataset (rank and world size from jax.process_index()
    # and jax.process_count()), decoded and batched by Grain.
    ds = shardd.grain.ShardDataset(args.dataset, socket=args.socket, seed=args.seed,
                                   num_epochs=args.epochs, num_streams=args.streams)
    it = iter(ds.map(decode(args.image_size)).batch(args.batch_size))

    params = init_params(jax.random.PRNGKey(args.seed), args.image_size, args.classes)
    state = {"params": params, "velocity": jax.tree_util.tree_map(jnp.zeros_like, params)}
    # Synchronous saves: a kill right after save() must find the checkpoint complete.
    manager = ocp.CheckpointManager(
        pathlib.Path(args.checkpoint).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False))
    global_step, log_bytes = 0, 0
    latest = manager.latest_step()
    if latest is not None:
        restored = manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state),
            data=grain.checkpoint.CheckpointRestore(it),
            meta=ocp.args.JsonRestore()))
        state = restored["state"]
        global_step, log_bytes = restored["meta"]["step"], restored["meta"]["log_bytes"]
        print(f"resuming at step {global_step}", flush=True)
    log = None
    if args.log:
        log = open(args.log, "a+")
        log.truncate(log_bytes)  # steps trained after the checkpoint are trained again
        log.seek(log_bytes)

    step_fn = make_step(args.lr)
    began, seen, total = time.monotonic(), 0, 0.0
    for batch in it:
        state, loss = step_fn(state, jnp.asarray(batch["image"]), jnp.asarray(batch["label"]))
        global_step += 1
        seen += len(batch["label"])
        total += float(loss) * len(batch["label"])
        if log:
            log.write("".join(f"{global_step - 1} {k.decode()}\n" for k in batch["key"]))
            log.flush()
        if global_step % args.checkpoint_every == 0:
            manager.save(global_step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(it),
                meta=ocp.args.JsonSave({"step": global_step,
                                        "log_bytes": log.tell() if log else 0})))
        if global_step == args.kill_at_step:
            print(f"killing myself after step {global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    if seen:
        print(f"{seen} samples, {global_step} steps, loss {total / seen:.4f}, "
              f"{seen / (time.monotonic() - began):.0f} samples/s", flush=True)
    if args.final:
        leaves = {k: np.asarray(v) for k, v in state["params"].items()}
        np.savez(args.final, **leaves)
        print(json.dumps({k: v.shape for k, v in leaves.items()}), flush=True)


if __name__ == "__main__":
    main()
