"""The client's batch decoders (shardd/_decode.py) give the same samples: the compiled one
(clients/python/native/decode.rs) and the pure-Python ones, the loop, which takes any batch,
and the shaped decoders made for batches whose samples all have the same number of fields. A
batch that does not add up is a ProtocolError from each. Batches are encoded here as the
daemon lays them out (proto/PROTOCOL.md); the end-to-end tests (test_zerocopy.py,
test_streams.py) read the daemon's own, with the compiled decoder (conftest.py)."""

import contextlib
import functools
import random
import struct

import pytest
from shardd import _decode
from shardd._errors import ProtocolError

from conftest import DECODER, compiled_decoder

NAMES = ["jpg", "cls", "json", "txt"]
URLS = ["gs://b/a.tar", "gs://b/é.tar"]


class Map:
    """A map's stand-in: slicing it says which range was asked for (offsets past 4 GiB too,
    which no test could map)."""

    def __init__(self, map_id):
        self.map_id = map_id

    def __getitem__(self, s):
        return ("map", self.map_id, s.start, s.stop)


def encode(samples, mapped):
    """(n, words, payload) of a batch of ``samples``: (key, url index, [(name index, value)]),
    where a value is bytes (in the payload) or, mapped, (map id, offset, length)."""
    words, payload = [], bytearray()
    for key, url, fields in samples:
        k = key.encode()
        words += [len(fields) << 16 | url, len(k)]
        payload += k
        for name, value in fields:
            if isinstance(value, bytes):
                words += [name, len(value)] + ([0, 0, 0] if mapped else [])
                payload += value
            else:
                map_id, off, ln = value
                words += [1 << 31 | name, ln, map_id, off & 0xFFFFFFFF, off >> 32]
    return len(samples), tuple(words), bytes(payload)


def expected(samples, maps):
    out = []
    for key, url, fields in samples:
        s = {"__key__": key, "__url__": URLS[url]}
        for name, value in fields:
            s[NAMES[name]] = value if isinstance(value, bytes) else maps[value[0]][
                slice(value[1], value[1] + value[2])]
        out.append(s)
    return out


def random_samples(rng, n, fields, mapped):
    """``n`` samples of ``fields`` fields each (None: 0-3 each), mapped ones among them if
    ``mapped`` (a field mapped in one sample may be inline in the next, as the daemon sends
    a piece inline once its maps are used up)."""
    out = []
    for i in range(n):
        f = rng.randrange(4) if fields is None else fields
        vals = []
        for name in rng.sample(range(len(NAMES)), f):
            if mapped and rng.random() < 0.6:
                vals.append((name, (rng.choice([1, 2]), rng.choice([0, 5 << 32]) + rng.randrange(1 << 20),
                                    rng.randrange(1, 1 << 16))))
            else:
                vals.append((name, rng.randbytes(rng.randrange(0, 40))))
        out.append((f"sample-{i}-ü" if i % 7 == 0 else f"sample-{i}", rng.randrange(len(URLS)), vals))
    return out


# The compiled decoder, as cargo built it (whatever SHARDD_DECODER says for the rest).
COMPILED = _decode._load(compiled_decoder())


@contextlib.contextmanager
def decoder(compiled):
    """``batch`` and ``mapped_batch`` decode with the compiled decoder, or in Python."""
    saved = _decode._compiled
    _decode._compiled = COMPILED if compiled else None
    try:
        yield
    finally:
        _decode._compiled = saved


def decode(compiled, mapped, n, words, payload, maps, at=0, max_piece=None):
    """``batch`` or ``mapped_batch`` as the client calls them: ``words`` (a tuple) packed,
    a MAPPED_BATCH's payload at ``at`` in a bytearray (``max_piece``: its largest piece, at
    most its length)."""
    packed = struct.pack(f"<{len(words)}I", *words)
    with decoder(compiled):
        if not mapped:
            return _decode.batch(n, NAMES, URLS, packed, payload, "s")
        buf = bytearray(b"x" * at + payload + b"y")
        return _decode.mapped_batch(n, NAMES, URLS, packed, memoryview(buf), at,
                                    at + len(payload), max_piece or len(payload), maps, "s")


# The loops themselves, for comparisons (``loops_taken`` wraps them in the module).
ANY_BATCH, ANY_MAPPED = _decode._any_batch, _decode._any_mapped


def loops_taken(monkeypatch):
    """A list that gets an entry each time ``batch`` or ``mapped_batch`` takes the loop."""
    taken = []
    for name, loop in (("_any_batch", ANY_BATCH), ("_any_mapped", ANY_MAPPED)):
        monkeypatch.setattr(_decode, name, lambda *a, loop=loop: taken.append(1) or loop(*a))
    return taken


@pytest.mark.parametrize("fields", [0, 1, 2, 3])
def test_a_batch_of_one_shape_is_decoded_shaped_and_equals_the_loop(fields, monkeypatch):
    rng = random.Random(fields)
    taken = loops_taken(monkeypatch)
    for _ in range(20):
        samples = random_samples(rng, rng.randrange(1, 50), fields, mapped=False)
        n, words, payload = encode(samples, mapped=False)
        want = expected(samples, {})
        assert _decode.python_batch(n, NAMES, URLS, words, payload) == want
        assert ANY_BATCH(n, NAMES, URLS, words, payload) == want
    assert not taken, "the shaped decoder takes every batch of one shape"


@pytest.mark.parametrize("fields", [0, 1, 2, 3])
def test_a_mapped_batch_of_one_shape_is_decoded_shaped_and_equals_the_loop(fields, monkeypatch):
    rng = random.Random(fields)
    maps = {1: Map(1), 2: Map(2)}
    taken = loops_taken(monkeypatch)
    for _ in range(20):
        samples = random_samples(rng, rng.randrange(1, 50), fields, mapped=True)
        n, words, payload = encode(samples, mapped=True)
        # The payload is a slice of the connection's buffer.
        prefix = b"x" * rng.randrange(10)
        mv = memoryview(prefix + payload + b"y")[len(prefix) : len(prefix) + len(payload)]
        want = (expected(samples, maps),
                sum(v[2] for _, _, fs in samples for _, v in fs if not isinstance(v, bytes)))
        assert _decode.python_mapped_batch(n, NAMES, URLS, words, mv, 40, maps, "s") == want
        assert ANY_MAPPED(n, NAMES, URLS, words, mv, maps, "s") == want
    assert not taken, "the shaped decoder takes every batch of one shape"


def test_samples_with_different_numbers_of_fields_go_to_the_loop(monkeypatch):
    rng = random.Random(7)
    maps = {1: Map(1), 2: Map(2)}
    taken = loops_taken(monkeypatch)
    # The first samples have one shape and a later one another; samples whose words add up to
    # as many as three samples of the first one's shape would have (2 + 0 + 4 fields); any.
    uneven = [random_samples(rng, 9, 2, True) + random_samples(rng, 1, 3, True)
              + random_samples(rng, 5, 2, True),
              random_samples(rng, 1, 2, True) + random_samples(rng, 1, 0, True)
              + random_samples(rng, 1, 4, True),
              random_samples(rng, 40, None, True)]
    for samples in uneven:
        n, words, payload = encode(samples, mapped=True)
        assert _decode.python_mapped_batch(n, NAMES, URLS, words, memoryview(payload), 40, maps, "s") == (
            expected(samples, maps), sum(v[2] for _, _, fs in samples for _, v in fs
                                         if not isinstance(v, bytes)))
        plain = [(k, u, [(nm, v if isinstance(v, bytes) else b"v") for nm, v in fs])
                 for k, u, fs in samples]
        n, words, payload = encode(plain, mapped=False)
        assert _decode.python_batch(n, NAMES, URLS, words, payload) == expected(plain, {})
    assert len(taken) == 6, "the loop takes every batch of uneven samples"


def test_a_map_the_daemon_did_not_send_is_named_by_either_decoder():
    samples = [("a", 0, [(0, (1, 0, 10))]), ("b", 0, [(0, (9, 0, 10))])]
    n, words, payload = encode(samples, mapped=True)
    for decode in (functools.partial(_decode.python_mapped_batch, max_piece=1), ANY_MAPPED):
        with pytest.raises(ProtocolError, match="^the daemon at s referred to map 9, which it did "
                                                "not send$"):
            decode(n, NAMES, URLS, words, memoryview(payload), maps={1: Map(1)}, path="s")


def test_a_mapped_batch_with_large_inline_pieces_goes_to_the_loop(monkeypatch):
    """A piece the daemon could not map comes inline: the loop copies it once, where the
    shaped decoder would copy the payload and then the piece."""
    samples = [(f"k{i}", 0, [(0, bytes(5000) if i % 2 else (1, 0, 10))]) for i in range(4)]
    n, words, payload = encode(samples, mapped=True)
    taken = loops_taken(monkeypatch)
    maps = {1: Map(1)}
    assert _decode.python_mapped_batch(n, NAMES, URLS, words, memoryview(payload), 5000, maps, "s") == (
        expected(samples, maps), 20)
    assert len(taken) == 1


def test_empty_batches():
    assert _decode.python_batch(0, NAMES, URLS, (), b"") == []
    assert _decode.python_mapped_batch(0, NAMES, URLS, (), memoryview(b""), 0, {}, "s") == ([], 0)
    for compiled in (True, False):
        with decoder(compiled):
            assert _decode.batch(0, NAMES, URLS, b"", b"", "s") == []
            assert _decode.mapped_batch(0, NAMES, URLS, b"", memoryview(bytearray()), 0, 0, 0, {},
                                        "s") == ([], 0)


def test_more_fields_than_shaped_decoders_are_made_for_go_to_the_loop(monkeypatch):
    fields = _decode.SHAPED_MAX + 1
    samples = [(f"k{i}", 0, [(j % len(NAMES), bytes([j])) for j in range(fields)])
               for i in range(3)]
    taken = loops_taken(monkeypatch)
    n, words, payload = encode(samples, mapped=False)
    assert _decode.python_batch(n, NAMES, URLS, words, payload) == expected(samples, {})
    assert len(taken) == 1


def test_the_shaped_decoders_bounds_are_inclusive_and_each_is_made_once(monkeypatch):
    """SHAPED_MAX fields, and a mapped batch whose largest piece is SMALL_PIECE, still take a
    shaped decoder; a shape's decoder is compiled once and kept."""
    fields = _decode.SHAPED_MAX
    samples = [(f"k{i}", 0, [(j % len(NAMES), bytes([j])) for j in range(fields)]) for i in range(3)]
    taken = loops_taken(monkeypatch)
    n, words, payload = encode(samples, mapped=False)
    assert _decode.python_batch(n, NAMES, URLS, words, payload) == expected(samples, {})
    samples = [("k", 0, [(0, bytes(_decode.SMALL_PIECE))])]
    n, words, payload = encode(samples, mapped=True)
    assert _decode.python_mapped_batch(n, NAMES, URLS, words, memoryview(payload), _decode.SMALL_PIECE,
                                       {}, "s") == (expected(samples, {}), 0)
    assert not taken
    assert _decode._shaped("batch", 3) is _decode._shaped("batch", 3)
    assert _decode._shaped("batch", 3) is not _decode._shaped("mapped", 3)


@pytest.mark.parametrize("mapped", [False, True])
def test_the_compiled_decoder_gives_the_samples_of_the_python_one(mapped):
    rng = random.Random(11)
    maps = {1: Map(1), 2: Map(2)}
    many = _decode.SHAPED_MAX + 1
    for i in range(60):
        if i % 6 == 5:  # more fields than the shaped decoders take
            samples = [(f"k{k}", 0, [(j % len(NAMES), bytes([j])) for j in range(many)])
                       for k in range(3)]
        else:
            samples = random_samples(rng, rng.randrange(1, 60), [0, 1, 2, 3, None][i % 6],
                                     mapped)
        if i % 4 == 0:  # a large piece inline (one the daemon could not map)
            samples.append(("big", 1, [(0, rng.randbytes(70_000))]))
        n, words, payload = encode(samples, mapped)
        max_piece = max([len(v) for _, _, fs in samples for _, v in fs if isinstance(v, bytes)]
                        + [len(k) for k, _, _ in samples])
        want = expected(samples, maps)
        if mapped:
            want = (want, sum(v[2] for _, _, fs in samples for _, v in fs
                              if not isinstance(v, bytes)))
        at = rng.randrange(10)
        assert decode(True, mapped, n, words, payload, maps, at, max_piece) == want
        assert decode(False, mapped, n, words, payload, maps, at, max_piece) == want
    assert _decode.DECODER == DECODER, "conftest.py chooses the suite's decoder"


def test_a_map_the_daemon_did_not_send_is_named_by_the_compiled_decoder():
    n, words, payload = encode([("a", 0, [(0, (1, 0, 10))]), ("b", 0, [(0, (9, 0, 10))])], True)
    with pytest.raises(ProtocolError, match="^the daemon at s referred to map 9, which it did not "
                                            "send$"):
        decode(True, True, n, words, payload, {1: Map(1)})


def outcome(compiled, mapped, n, words, payload, maps):
    try:
        return decode(compiled, mapped, n, words, payload, maps)
    except ProtocolError:
        return "ProtocolError"


@pytest.mark.parametrize("mapped", [False, True])
def test_a_batch_that_does_not_add_up_is_a_protocol_error_from_either_decoder(mapped):
    """Batches broken as a daemon's bug or a stranger on the socket could: each decoder
    decodes them to the same samples or raises ProtocolError, never anything else (nor
    crashes the interpreter)."""
    rng = random.Random(3)
    maps = {1: memoryview(rng.randbytes(1 << 16)), 2: memoryview(rng.randbytes(1 << 10))}
    errors = 0
    for i in range(3000):
        samples = random_samples(rng, rng.randrange(1, 8), None, mapped)
        samples = [(k, u, [(nm, (m, off % (1 << 16), ln % 300) if isinstance(v, tuple) else v)
                           for nm, v in fs for m, off, ln in [v if isinstance(v, tuple)
                                                              else (0, 0, 0)]])
                   for k, u, fs in samples]
        n, words, payload = encode(samples, mapped)
        words = list(words)
        how = i % 8
        if how == 0 and words:  # any word, any value
            words[rng.randrange(len(words))] = rng.choice([0, 1, 7, 0xFFFF, 1 << 31, 0xFFFFFFFF,
                                                          rng.getrandbits(32)])
        elif how == 1:  # words cut short
            words = words[: rng.randrange(len(words))]
        elif how == 2:  # payload cut short
            payload = payload[: rng.randrange(len(payload) + 1)]
        elif how == 3:  # more samples than it has
            n += rng.randrange(1, 3)
        elif how == 4:  # a key that is not UTF-8
            payload = b"\xff" + payload[1:]
        elif how == 5:  # a field name or URL its tables do not have
            words[rng.choice([0, 2]) if len(words) > 2 else 0] |= 0x7FF0
        elif how == 6:  # one bit flipped in the payload
            if payload:
                k = rng.randrange(len(payload))
                payload = payload[:k] + bytes([payload[k] ^ 0x80]) + payload[k + 1:]
        got = outcome(True, mapped, n, tuple(words), payload, maps)
        assert got == outcome(False, mapped, n, tuple(words), payload, maps), (how, words)
        errors += got == "ProtocolError"
    assert 1000 < errors < 2900  # the broken batches did break, the harmless ones decoded


UAF = """
import gc, struct, sys
from shardd import _decode
decode_mapped = _decode._load(sys.argv[1])[1]
maps = {1: memoryview(bytearray(b"A" * 100000))}

class Trap:
    def __del__(self):  # drops the map the decoder is slicing, then reuses the memory
        maps.clear()
        global junk
        junk = [bytearray(b"Z" * 200) for _ in range(2000)]

n = 200
words = struct.pack("<7I", 1 << 16, 0, 1 << 31, 4, 1, 0, 0) * n
gc.collect()
gc.set_threshold(100000)
t = Trap()
t.self = t
del t  # cyclic garbage with a finalizer, collected at an allocation inside the call
gc.set_threshold(int(sys.argv[2]))
out, mapped = decode_mapped(words, n, ["f"], ["u"], bytearray(), 0, 0, maps)
gc.set_threshold(700)
print(len(out), mapped, sorted({bytes(s["f"]) for s in out}), maps)
"""


@pytest.mark.parametrize("threshold", [20, 40])
def test_a_map_dropped_by_a_finalizer_mid_batch_stays_valid_for_the_batch(threshold):
    """The compiled decoder keeps its own reference to the map it slices: a garbage collection
    inside the call (Python 3.11 and older collect at allocations) may run a finalizer that
    drops the dict's (it crashed the interpreter when the reference was borrowed)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", UAF, compiled_decoder(), str(threshold)],
                         capture_output=True, text=True, cwd=_decode.__file__.rsplit("/", 2)[0])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "200 800 [b'AAAA'] {}"


@pytest.mark.parametrize("compiled", [True, False])
def test_what_a_malformed_batch_is_said_to_be(compiled):
    """Each way a batch can fail to add up has its own words, the same from both decoders
    (the loop's IndexError says both of the compiled decoder's last two)."""
    samples = [("k", 0, [(0, b"abcdef"), (1, b"gh")])]
    n, words, payload = encode(samples, mapped=False)
    bad_name = (words[0], words[1], 0x7FF0) + words[3:]
    cases = [(False, n, words, payload[:-1], "a batch's pieces run past the end of its payload"),
             (False, n, bad_name, payload, "a batch names a field or URL its tables do not have")]
    n, words, payload = encode([("k", 0, [(0, b"abc")])], mapped=True)
    cases.append((True, n, words[:-3], payload, "a batch's samples need more descriptor words than it has"))
    for mapped, n, words, payload, why in cases:
        with pytest.raises(ProtocolError) as e:
            decode(compiled, mapped, n, words, payload, {})
        assert str(e.value).startswith(f"the daemon at s sent a malformed batch: {why}"), str(e.value)


def test_shardd_decoder_chooses_the_decoder(monkeypatch, tmp_path):
    """``python``: the pure-Python one. A path: that library, or an ImportError that names
    it and why (never a silent fallback). Unset: the library beside the module where there
    is one and it loads (a warning and Python where it does not), else Python."""
    lib = compiled_decoder()
    assert _decode._load("python") is None
    assert _decode._load(lib) is not None
    for chosen, why in [(str(tmp_path / "none.so"), "cannot open shared object file"),
                        (__file__, "invalid ELF header")]:
        with pytest.raises(ImportError, match=f"^SHARDD_DECODER={chosen}: cannot load it: .*{why}"):
            _decode._load(chosen)
    monkeypatch.setattr(_decode, "_ABI", 2)
    with pytest.raises(ImportError, match="it speaks version 1 of its interface, this client 2$"):
        _decode._load(lib)
    monkeypatch.setattr(_decode, "_ABI", 1)
    monkeypatch.setattr(_decode, "LIBRARY", lib)
    assert _decode._load("") is not None
    monkeypatch.setattr(_decode, "LIBRARY", str(tmp_path / "absent.so"))
    assert _decode._load("") is None
    monkeypatch.setattr(_decode, "LIBRARY", __file__)
    with pytest.warns(RuntimeWarning, match=f"^shardd: the compiled decoder {__file__} cannot be loaded "
                                            r"\(.*\); decoding in Python, which costs more CPU per sample$"):
        assert _decode._load("") is None


def test_an_interpreter_without_the_stable_abi_decodes_in_python(monkeypatch):
    """A free-threaded CPython (or PyPy) cannot load a stable-ABI library: it is not tried."""
    import sys
    import sysconfig

    assert _decode._stable_abi()  # the CPython this suite runs on
    monkeypatch.setattr(_decode, "LIBRARY", compiled_decoder())
    assert _decode._load("") is not None
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else real(name))
    assert not _decode._stable_abi()
    assert _decode._load("") is None
    monkeypatch.undo()
    monkeypatch.setattr(sys.implementation, "name", "pypy")
    assert not _decode._stable_abi()


def test_a_source_tree_without_the_library_decodes_in_python_silently():
    """What ``import shardd`` does with SHARDD_DECODER unset and no library beside the
    module (the source tree: cargo builds it elsewhere)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SHARDD_DECODER"}
    run = subprocess.run([sys.executable, "-W", "error", "-c", "from shardd import _decode; print(_decode.DECODER)"],
                         capture_output=True, text=True, env=env, cwd=_decode.__file__.rsplit("/", 2)[0])
    assert run.returncode == 0, run.stderr
    assert run.stdout == "python\n"
