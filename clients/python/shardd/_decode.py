"""Decoding a batch's samples from its descriptor words (proto/PROTOCOL.md "BATCH" and "Zero
copy"): the per-sample code, where most of a trainer's per-sample time in the client goes.

A sample's words are its head (fields << 16 | URL index) and key length, then per field: in a
BATCH, its name index and length (the bytes follow the key in the payload); in a
MAPPED_BATCH, its name index (top bit: mapped), length, map id and offset (low, high word),
where an unmapped field's bytes follow in the payload as in a BATCH.

Two decoders give the same samples:

- the compiled one (clients/python/native/decode.rs), which the wheel carries as
  ``libshardd_decode.so`` beside this file and which is loaded with ``ctypes.PyDLL``: one call
  per batch. It cut the client's cost of a 10 KB zero-copy sample by half (docs/benchmarks.md,
  "The compiled decoder");
- the pure-Python one, where the library is absent (the client-only distribution, a source
  tree) or cannot load. Of it, the loop (``_any_batch``, ``_any_mapped``) takes any batch, each
  sample with its own number of fields; a shaped decoder (``_shaped``) is made for batches whose
  samples all have the same number of fields, nearly always so: its ``for`` unpacks a sample's
  words into local names in one step, and one dict display makes the sample.

``SHARDD_DECODER`` chooses: ``python`` for the pure-Python decoder, a path for that library
(tests, a source tree), unset for the library beside this file if there is one. ``DECODER``
says which one this process uses. ``batch`` and ``mapped_batch`` take it.
"""

import os
import struct
import sys
import sysconfig
import warnings

from ._errors import ProtocolError

# The most fields per sample a shaped decoder is made for (one per number and layout, kept):
# more is decoded by the loop, so odd batches cannot make the client compile without bound.
SHAPED_MAX = 16

# A MAPPED_BATCH's shaped decoder copies its payload once and slices that: for small pieces
# only (what the daemon always sends inline, src/protocol.rs INLINE_MAX), not large ones it
# sends inline when it cannot map them, which the loop copies once each.
SMALL_PIECE = 4096

# Words per sample: the head and key length, then per field.
_HEAD_WORDS = 2
_FIELD_WORDS = {"batch": 2, "mapped": 5}

# The compiled decoder's interface version (decode.rs ``shardd_decode_abi``).
_ABI = 1
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libshardd_decode.so")

_made = {}


def _load(chosen):
    """The compiled decoder's two functions, or None for the pure-Python decoder. ``chosen``:
    ``SHARDD_DECODER``."""
    if chosen == "python":
        return None
    path = chosen or LIBRARY
    if not chosen and not (os.path.exists(path) and _stable_abi()):
        return None
    try:
        import ctypes  # here: a Python built without it still decodes in Python

        lib = ctypes.PyDLL(path)
        if lib.shardd_decode_abi() != _ABI:
            raise OSError(f"it speaks version {lib.shardd_decode_abi()} of its interface, "
                          f"this client {_ABI}")
        obj, size = ctypes.py_object, ctypes.c_ssize_t
        decode_batch, decode_mapped = lib.shardd_decode_batch, lib.shardd_decode_mapped
        decode_batch.argtypes = [obj, size, obj, obj, obj]
        decode_mapped.argtypes = [obj, size, obj, obj, obj, size, size, obj]
        decode_batch.restype = decode_mapped.restype = obj
    except (ImportError, OSError, AttributeError) as e:
        if chosen:  # asked for by name: say so, do not fall back unseen
            raise ImportError(f"SHARDD_DECODER={chosen}: cannot load it: {e}") from e
        warnings.warn(f"shardd: the compiled decoder {path} cannot be loaded ({e}); decoding "
                      f"in Python, which costs more CPU per sample", RuntimeWarning)
        return None
    return decode_batch, decode_mapped


def _stable_abi():
    """Whether this interpreter runs libraries built for CPython's stable ABI: not PyPy, not a
    free-threaded build (which decode in Python)."""
    return (sys.implementation.name == "cpython"
            and not sysconfig.get_config_var("Py_GIL_DISABLED"))


_compiled = _load(os.environ.get("SHARDD_DECODER", ""))
DECODER = "python" if _compiled is None else "compiled"


def batch(n, names, urls, words, data, path):
    """The ``n`` samples of a BATCH whose descriptor words are ``words`` and payload ``data``
    (both bytes): fields are bytes. ``path``: the daemon's socket, for messages."""
    if _compiled is not None:
        try:
            return _compiled[0](words, n, names, urls, data)
        except ValueError as e:
            raise malformed(path, e) from None
    try:
        return python_batch(n, names, urls, _unpack(words), data)
    except (IndexError, ValueError) as e:
        raise malformed(path, _why(e)) from None


def mapped_batch(n, names, urls, words, mv, at, end, max_piece, maps, path):
    """The ``n`` samples of a MAPPED_BATCH, and the bytes of their mapped fields: mapped fields
    are memoryviews of ``maps`` (map id -> memoryview of the mapping), the others bytes from
    ``mv[at:end]`` (``mv`` a memoryview of a bytearray: the batch's keys and unmapped fields,
    the largest ``max_piece`` bytes)."""
    if _compiled is not None:
        try:
            return _compiled[1](words, n, names, urls, mv.obj, at, end, maps)
        except ValueError as e:
            raise malformed(path, e) from None
        except KeyError as e:
            raise _missing_map(path, e.args[0]) from None
    try:
        return python_mapped_batch(n, names, urls, _unpack(words), mv[at:end], max_piece, maps,
                                   path)
    except (IndexError, ValueError) as e:
        raise malformed(path, _why(e)) from None


# What both decoders say of a batch whose pieces add up to more than its payload.
OVERRUN = "a batch's pieces run past the end of its payload"


def _why(e):
    """What a Python decoder's error says of the batch: an IndexError is an index past the end
    of its words or of a table."""
    if isinstance(e, IndexError):
        return "a batch names a field or URL its tables do not have, or needs more words"
    return e


def _unpack(words):
    return struct.unpack(f"<{len(words) // 4}I", words)


def malformed(path, why):
    """The error for a batch from the daemon at ``path`` that does not add up."""
    return ProtocolError(f"the daemon at {path} sent a malformed batch: {why}")


def _missing_map(path, map_id):
    return ProtocolError(f"the daemon at {path} referred to map {map_id}, which it did not send")


# -- the pure-Python decoder ----------------------------------------------------------------


def python_batch(n, names, urls, words, data):
    """``batch`` in Python, ``words`` unpacked. A batch that does not add up raises
    IndexError or ValueError."""
    decoded = _try_shaped("batch", n, words, (words, data, names, urls))
    return decoded if decoded is not None else _any_batch(n, names, urls, words, data)


def python_mapped_batch(n, names, urls, words, payload, max_piece, maps, path):
    """``mapped_batch`` in Python, ``words`` unpacked, ``payload`` a memoryview; errors as
    ``python_batch``'s."""
    try:
        decoded = (_try_shaped("mapped", n, words, (words, payload, names, urls, maps))
                   if max_piece <= SMALL_PIECE else None)
    except KeyError:
        decoded = None  # a map the daemon did not send: the loop says which
    if decoded is not None:
        return decoded
    return _any_mapped(n, names, urls, words, payload, maps, path)


def _try_shaped(layout, n, words, args):
    """The shaped decoder's result, or None where it does not apply (samples with different
    numbers of fields, or too many)."""
    if not n:
        return None
    fields = words[0] >> 16
    if fields > SHAPED_MAX or len(words) != n * (_HEAD_WORDS + _FIELD_WORDS[layout] * fields):
        return None
    return _shaped(layout, fields)(*args)


def _any_batch(n, names, urls, words, data):
    """``batch`` for any batch: samples with any number of fields."""
    out = []
    append = out.append
    p = i = 0
    for _ in range(n):
        head = words[i]
        q = p + words[i + 1]
        sample = {"__key__": str(data[p:q], "utf-8"), "__url__": urls[head & 0xFFFF]}
        i += 2
        for _ in range(head >> 16):
            p = q
            q += words[i + 1]
            sample[names[words[i]]] = data[p:q]
            i += 2
        p = q
        append(sample)
    if p > len(data):
        raise ValueError(OVERRUN)
    return out


def _any_mapped(n, names, urls, words, mv, maps, path):
    """``mapped_batch`` for any batch: samples with any number of fields."""
    out = []
    p = i = 0
    mapped = 0
    for _ in range(n):
        head = words[i]
        klen = words[i + 1]
        i += 2
        sample = {"__key__": str(mv[p : p + klen], "utf-8"), "__url__": urls[head & 0xFFFF]}
        p += klen
        for _ in range(head >> 16):
            name, ln = words[i], words[i + 1]
            if name >> 31:
                mapped += ln
                off = words[i + 3] | (words[i + 4] << 32)
                try:
                    sample[names[name & 0x7FFFFFFF]] = maps[words[i + 2]][off : off + ln]
                except KeyError:
                    raise _missing_map(path, words[i + 2]) from None
            else:
                sample[names[name]] = mv[p : p + ln].tobytes()
                p += ln
            i += 5
        out.append(sample)
    if p > len(mv):
        raise ValueError(OVERRUN)
    if i > len(words):  # an inline field's last three words (unused) are missing
        raise ValueError("a batch's samples need more descriptor words than it has")
    return out, mapped


def _shaped(layout, fields):
    """The shaped decoder for ``layout`` and ``fields`` fields per sample (made once, then
    kept). It returns what ``batch`` or ``mapped_batch`` returns, or None at the first sample
    with another number of fields; a map it was not sent raises KeyError."""
    decode = _made.get((layout, fields))
    if decode is None:
        decode = _made[layout, fields] = _make_shaped(layout, fields)
    return decode


def _make_shaped(layout, fields):
    """Writes and compiles a shaped decoder: the loop's steps for one sample, with each field's
    words as locals: n<j> (name index), l<j> (length) and, mapped, m<j> (map id), lo<j> and
    hi<j> (offset). ``p`` is where the next payload bytes begin. Slices of a bytes object and
    ``bytes.decode`` are the cheapest way to each piece (a memoryview slice is an object
    more)."""
    if layout == "batch":
        params, result = "words, data, names, urls", "out"
        targets = [f"n{j}, l{j}" for j in range(fields)]
        prologue = []
        per_field = [line for j in range(fields)
                     for line in (f"q = p + l{j}", f"v{j} = data[p:q]", "p = q")]
    else:
        params, result = "words, payload, names, urls, maps", "out, mapped"
        targets = [f"n{j}, l{j}, m{j}, lo{j}, hi{j}" for j in range(fields)]
        prologue = [
            "data = payload.tobytes()",
            "mapped = 0",
            # A mapped field's name word has the top bit set: both words name the field.
            "names = {**dict(enumerate(names)), **{i | 0x80000000: s for i, s in enumerate(names)}}",
        ]
        per_field = [line for j in range(fields) for line in (
            f"if n{j} >> 31:",
            f"    lo{j} |= hi{j} << 32",
            f"    v{j} = maps[m{j}][lo{j} : lo{j} + l{j}]",
            f"    mapped += l{j}",
            "else:",
            f"    q = p + l{j}",
            f"    v{j} = data[p:q]",
            "    p = q",
        )]
    stride = _HEAD_WORDS + _FIELD_WORDS[layout] * fields
    entries = "".join(f", names[n{j}]: v{j}" for j in range(fields))
    lines = [
        f"def decode({params}):",
        *(f"    {line}" for line in prologue),
        "    out = []",
        "    append = out.append",
        "    p = 0",
        f"    for {', '.join(['head, klen'] + targets)} in zip(*[iter(words)] * {stride}):",
        f"        if head >> 16 != {fields}:",
        "            return None",
        "        q = p + klen",
        "        key = data[p:q].decode()",
        "        p = q",
        *(f"        {line}" for line in per_field),
        f"        append({{'__key__': key, '__url__': urls[head & 0xFFFF]{entries}}})",
        "    if p > len(data):",
        "        raise ValueError(OVERRUN)",
        f"    return {result}",
    ]
    scope = {"OVERRUN": OVERRUN}
    exec(compile("\n".join(lines), f"<shardd: {layout} of {fields} fields>", "exec"), scope)
    return scope["decode"]
