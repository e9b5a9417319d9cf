//! The Python client's compiled batch decoder: what `shardd/_decode.py` does in Python (its
//! docstring and proto/PROTOCOL.md "BATCH" and "Zero copy" give the layout), in one call per
//! batch instead of ~30 bytecodes per field. At 10 KB per sample, decoding was most of what the
//! client cost a trainer per sample (docs/benchmarks.md, "The compiled decoder").
//!
//! Not a Python extension module: the wheel is maturin `bindings = "bin"` (the daemon), which
//! cannot also hold one (PyO3/maturin#368). build.rs compiles this file alone with rustc into a
//! shared library the wheel carries as `shardd/libshardd_decode.so`, and the client loads it
//! with `ctypes.PyDLL` (the GIL held, Python's error indicator checked after each call). So it
//! has no dependencies and declares the few CPython functions it calls itself: all in the
//! stable ABI, so one library serves CPython 3.8 and newer (PyPy and free-threaded builds
//! decode in Python).
//!
//! Hostile input is the daemon's problem, not the trainer's: every index into the words, the
//! payload and the name and URL tables is checked against the frame, and a batch that does not
//! add up raises `ValueError` (the client makes it a `ProtocolError`). Nothing here panics.
//! The map it keeps from one field to the next is a reference of its own (an allocation can
//! run a garbage collection, whose finalizers could drop the dict's); the tables' items it
//! borrows are in lists that only the caller holds.

use std::ffi::{c_char, c_int};
use std::ptr::null_mut;

/// A Python object; only ever handled by pointer.
#[repr(C)]
pub struct PyObject {
    _opaque: [u8; 0],
}
type Obj = *mut PyObject;

unsafe extern "C" {
    static mut PyExc_ValueError: Obj;
    static mut PyExc_TypeError: Obj;
    static mut PyExc_KeyError: Obj;
    fn PyErr_SetString(kind: Obj, message: *const c_char);
    fn PyErr_SetObject(kind: Obj, value: Obj);
    fn PyErr_Occurred() -> Obj;
    fn Py_DecRef(o: Obj);
    fn Py_IncRef(o: Obj);
    /// 1, 0, or -1 with an error set.
    fn PyObject_IsInstance(o: Obj, class: Obj) -> c_int;
    static mut PyByteArray_Type: PyObject;
    fn PyList_New(len: isize) -> Obj;
    fn PyList_Append(list: Obj, item: Obj) -> c_int;
    /// Borrowed.
    fn PyList_GetItem(list: Obj, index: isize) -> Obj;
    fn PyList_Size(list: Obj) -> isize;
    fn PyDict_New() -> Obj;
    fn PyDict_SetItem(dict: Obj, key: Obj, value: Obj) -> c_int;
    /// Borrowed; NULL without an error set when absent.
    fn PyDict_GetItemWithError(dict: Obj, key: Obj) -> Obj;
    fn PyTuple_New(len: isize) -> Obj;
    /// Steals `item`.
    fn PyTuple_SetItem(tuple: Obj, index: isize, item: Obj) -> c_int;
    fn PyLong_FromUnsignedLongLong(v: u64) -> Obj;
    fn PyBytes_AsString(o: Obj) -> *mut c_char;
    fn PyBytes_Size(o: Obj) -> isize;
    fn PyBytes_FromStringAndSize(bytes: *const c_char, len: isize) -> Obj;
    fn PyByteArray_AsString(o: Obj) -> *mut c_char;
    fn PyByteArray_Size(o: Obj) -> isize;
    fn PyUnicode_DecodeUTF8(bytes: *const c_char, len: isize, errors: *const c_char) -> Obj;
    fn PyUnicode_InternFromString(s: *const c_char) -> Obj;
    /// `o[lo:hi]`: for a memoryview of a map, a memoryview of that range (clamped to it).
    fn PySequence_GetSlice(o: Obj, lo: isize, hi: isize) -> Obj;
}

/// Why a decode stopped. A Python error is already set for `Raised`.
enum Error {
    Raised,
    Malformed(&'static std::ffi::CStr),
    MissingMap(u32),
}

/// A new reference, released when dropped.
struct Owned(Obj);

impl Owned {
    /// Takes a new reference from a C API call (NULL: its error is set).
    fn new(o: Obj) -> Result<Owned, Error> {
        if o.is_null() {
            Err(Error::Raised)
        } else {
            Ok(Owned(o))
        }
    }

    /// Hands the reference to the caller.
    fn into_raw(self) -> Obj {
        let o = self.0;
        std::mem::forget(self);
        o
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        unsafe { Py_DecRef(self.0) }
    }
}

/// A status from the C API: -1 means an error is set.
fn status(rc: c_int) -> Result<(), Error> {
    if rc < 0 { Err(Error::Raised) } else { Ok(()) }
}

/// A borrowed reference (NULL: its error is set).
fn borrowed(o: Obj) -> Result<Obj, Error> {
    if o.is_null() {
        Err(Error::Raised)
    } else {
        Ok(o)
    }
}

/// The descriptor words, read in order.
struct Words<'a> {
    bytes: &'a [u8],
}

impl Words<'_> {
    fn next(&mut self) -> Result<u32, Error> {
        match self.bytes.split_first_chunk::<4>() {
            Some((word, rest)) => {
                self.bytes = rest;
                Ok(u32::from_le_bytes(*word))
            }
            None => Err(Error::Malformed(
                c"a batch's samples need more descriptor words than it has",
            )),
        }
    }
}

/// The payload: keys and inline fields, in order.
struct Payload<'a> {
    bytes: &'a [u8],
}

impl Payload<'_> {
    fn take(&mut self, len: u32) -> Result<&[u8], Error> {
        let len = len as usize;
        if len > self.bytes.len() {
            return Err(Error::Malformed(
                c"a batch's pieces run past the end of its payload",
            ));
        }
        let (piece, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(piece)
    }
}

unsafe fn bytes_of(piece: &[u8]) -> Result<Owned, Error> {
    Owned::new(unsafe { PyBytes_FromStringAndSize(piece.as_ptr().cast(), piece.len() as isize) })
}

/// A name or URL table (a list of str): `table[index]`, borrowed.
struct Table {
    list: Obj,
    len: isize,
}

impl Table {
    unsafe fn new(list: Obj) -> Result<Table, Error> {
        let len = unsafe { PyList_Size(list) };
        if len < 0 {
            Err(Error::Raised)
        } else {
            Ok(Table { list, len })
        }
    }

    unsafe fn get(&self, index: u32) -> Result<Obj, Error> {
        if index as isize >= self.len {
            return Err(Error::Malformed(
                c"a batch names a field or URL its tables do not have",
            ));
        }
        borrowed(unsafe { PyList_GetItem(self.list, index as isize) })
    }
}

/// The mapped fields of a MAPPED_BATCH: the map a field names, the last one kept (a batch's
/// fields nearly all come from one or two shards).
struct Maps {
    maps: Obj,
    /// A reference of its own: the allocations between two fields can run a garbage
    /// collection, and so finalizers, which could drop the dict's.
    last: Option<(u32, Owned)>,
}

impl Maps {
    /// `maps[id][offset:offset + len]`.
    unsafe fn slice(&mut self, id: u32, offset: u64, len: u32) -> Result<Owned, Error> {
        let map = match &self.last {
            Some((last, map)) if *last == id => map.0,
            _ => {
                let key = Owned::new(unsafe { PyLong_FromUnsignedLongLong(u64::from(id)) })?;
                let map = unsafe { PyDict_GetItemWithError(self.maps, key.0) };
                if map.is_null() {
                    return Err(if unsafe { has_error() } {
                        Error::Raised
                    } else {
                        Error::MissingMap(id)
                    });
                }
                unsafe { Py_IncRef(map) };
                self.last = Some((id, Owned(map)));
                map
            }
        };
        // Past isize::MAX a slice is empty either way (Python clamps it to the map).
        let lo = isize::try_from(offset).unwrap_or(isize::MAX);
        let hi = lo.saturating_add(len as isize);
        Owned::new(unsafe { PySequence_GetSlice(map, lo, hi) })
    }
}

unsafe fn has_error() -> bool {
    !unsafe { PyErr_Occurred() }.is_null()
}

/// Decodes `n` samples. `maps`: a MAPPED_BATCH's maps (its layout: five words per field),
/// None for a BATCH (two). Returns the samples and the mapped fields' bytes.
unsafe fn decode(
    words: &[u8],
    n: isize,
    names: Obj,
    urls: Obj,
    payload: &[u8],
    mut maps: Option<Maps>,
) -> Result<(Owned, u64), Error> {
    let key_name = Owned::new(unsafe { PyUnicode_InternFromString(c"__key__".as_ptr()) })?;
    let url_name = Owned::new(unsafe { PyUnicode_InternFromString(c"__url__".as_ptr()) })?;
    let out = Owned::new(unsafe { PyList_New(0) })?;
    let (names, urls) = unsafe { (Table::new(names)?, Table::new(urls)?) };
    let mut words = Words { bytes: words };
    let mut payload = Payload { bytes: payload };
    let mut mapped = 0u64;
    for _ in 0..n {
        let head = words.next()?;
        let key = payload.take(words.next()?)?;
        let key = Owned::new(unsafe {
            PyUnicode_DecodeUTF8(key.as_ptr().cast(), key.len() as isize, c"strict".as_ptr())
        })?;
        let url = unsafe { urls.get(head & 0xFFFF) }?;
        let sample = Owned::new(unsafe { PyDict_New() })?;
        status(unsafe { PyDict_SetItem(sample.0, key_name.0, key.0) })?;
        status(unsafe { PyDict_SetItem(sample.0, url_name.0, url) })?;
        for _ in 0..head >> 16 {
            let mut name = words.next()?;
            let len = words.next()?;
            let value = match maps.as_mut() {
                None => unsafe { bytes_of(payload.take(len)?) }?,
                Some(maps) => {
                    let (map, low, high) = (words.next()?, words.next()?, words.next()?);
                    if name >> 31 == 1 {
                        name &= 0x7FFF_FFFF;
                        mapped += u64::from(len);
                        unsafe { maps.slice(map, u64::from(low) | u64::from(high) << 32, len) }?
                    } else {
                        unsafe { bytes_of(payload.take(len)?) }?
                    }
                }
            };
            let name = unsafe { names.get(name) }?;
            status(unsafe { PyDict_SetItem(sample.0, name, value.0) })?;
        }
        status(unsafe { PyList_Append(out.0, sample.0) })?;
    }
    Ok((out, mapped))
}

/// The result to hand Python: the object, or NULL with the error set.
unsafe fn finish(result: Result<Obj, Error>) -> Obj {
    match result {
        Ok(o) => o,
        Err(Error::Raised) => null_mut(),
        Err(Error::Malformed(message)) => {
            unsafe { PyErr_SetString(PyExc_ValueError, message.as_ptr()) };
            null_mut()
        }
        Err(Error::MissingMap(id)) => {
            let id = unsafe { PyLong_FromUnsignedLongLong(u64::from(id)) };
            if !id.is_null() {
                unsafe { PyErr_SetObject(PyExc_KeyError, id) };
                unsafe { Py_DecRef(id) };
            }
            null_mut()
        }
    }
}

/// The version of this interface: the client loads a library only of the version it knows.
#[unsafe(no_mangle)]
pub extern "C" fn shardd_decode_abi() -> u32 {
    1
}

/// The `n` samples of a BATCH: `words` (bytes) its descriptor words, `data` (bytes) its payload,
/// `names` and `urls` (lists of str) its tables. Returns a list of dicts, fields as bytes.
///
/// # Safety
/// Called by CPython through ctypes.PyDLL, with the GIL, the arguments as described.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shardd_decode_batch(
    words: Obj,
    n: isize,
    names: Obj,
    urls: Obj,
    data: Obj,
) -> Obj {
    let result = (|| {
        let words = unsafe { bytes_arg(words) }?;
        let data = unsafe { bytes_arg(data) }?;
        let (out, _) = unsafe { decode(words, n, names, urls, data, None) }?;
        Ok(out.into_raw())
    })();
    unsafe { finish(result) }
}

/// The `n` samples of a MAPPED_BATCH, and the bytes of their mapped fields, as a tuple: its
/// payload is `buffer[at:end]` (a bytearray: the connection's receive buffer), `maps` the
/// stream's maps (map id -> memoryview of its mapping). Mapped fields are slices of their map,
/// the others bytes.
///
/// # Safety
/// As `shardd_decode_batch`; `buffer` is a bytearray.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shardd_decode_mapped(
    words: Obj,
    n: isize,
    names: Obj,
    urls: Obj,
    buffer: Obj,
    at: isize,
    end: isize,
    maps: Obj,
) -> Obj {
    let result = (|| {
        let words = unsafe { bytes_arg(words) }?;
        // PyByteArray_* trust their argument's type: checked here, not by the caller.
        match unsafe { PyObject_IsInstance(buffer, &raw mut PyByteArray_Type) } {
            1 => {}
            0 => {
                let message = c"shardd_decode_mapped: the buffer is not a bytearray";
                unsafe { PyErr_SetString(PyExc_TypeError, message.as_ptr()) };
                return Err(Error::Raised);
            }
            _ => return Err(Error::Raised),
        }
        let size = unsafe { PyByteArray_Size(buffer) };
        if at < 0 || at > end || end > size {
            return Err(Error::Malformed(
                c"a batch's payload is not within the receive buffer",
            ));
        }
        let base = unsafe { PyByteArray_AsString(buffer) };
        // The buffer outlives the call (the call's argument is a reference), and it is not
        // resized under it: the client's memoryview of it (`_frames.py`, `self._mv`) makes
        // any resize a BufferError, and the client replaces a buffer that must grow.
        let payload = unsafe {
            std::slice::from_raw_parts(base.cast::<u8>().add(at as usize), (end - at) as usize)
        };
        let maps = Maps { maps, last: None };
        let (out, mapped) = unsafe { decode(words, n, names, urls, payload, Some(maps)) }?;
        let pair = Owned::new(unsafe { PyTuple_New(2) })?;
        let mapped = Owned::new(unsafe { PyLong_FromUnsignedLongLong(mapped) })?;
        status(unsafe { PyTuple_SetItem(pair.0, 0, out.into_raw()) })?;
        status(unsafe { PyTuple_SetItem(pair.0, 1, mapped.into_raw()) })?;
        Ok(pair.into_raw())
    })();
    unsafe { finish(result) }
}

/// The bytes of a `bytes` object (TypeError for anything else).
unsafe fn bytes_arg<'a>(o: Obj) -> Result<&'a [u8], Error> {
    let base = unsafe { PyBytes_AsString(o) };
    if base.is_null() {
        return Err(Error::Raised);
    }
    let len = unsafe { PyBytes_Size(o) };
    Ok(unsafe { std::slice::from_raw_parts(base.cast::<u8>(), len as usize) })
}
