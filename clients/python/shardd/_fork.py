"""A stream is not shared across ``fork``: two processes reading one socket would each get part
of the bytes. What a forked child must disown (every open stream, and ``shardd.torch``'s
iterators) is registered here with the hook that closes the child's copy of its socket and
refuses to read on.
"""

import os
import weakref

# object -> hook(object). Weak: registering keeps nothing alive.
_LIVE = weakref.WeakKeyDictionary()


def register_fork_hook(obj, hook):
    """Calls ``hook(obj)`` in the child process of every later ``os.fork`` while ``obj`` lives
    and is registered. ``hook`` is a plain function (``type(obj).method``), not a bound method,
    so that the registry holds no reference to ``obj``."""
    _LIVE[obj] = hook


def unregister_fork_hook(obj):
    """Undoes ``register_fork_hook(obj, ...)`` (nothing if ``obj`` is not registered)."""
    _LIVE.pop(obj, None)


def _after_fork_in_child():
    # Newest first: a stream is disowned before the shardd.torch iterator that opened it, so it
    # forgets its read-ahead thread (whose lock the fork may have caught held) before anything
    # closes it.
    for obj, hook in reversed(list(_LIVE.items())):
        hook(obj)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
