use super::*;
use bytes::Bytes;

fn tar_of(members: &[(&str, &[u8])]) -> ShardBytes {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        // append_data writes GNU long-name records for names over 100 bytes.
        b.append_data(&mut h, name, *data).unwrap();
    }
    ShardBytes::heap(Bytes::from(b.into_inner().unwrap()))
}

fn keys_and_fields(samples: &[Sample]) -> Vec<(String, Vec<String>)> {
    samples
        .iter()
        .map(|s| {
            (
                s.key.to_string(),
                s.fields.iter().map(|(n, _)| n.to_string()).collect(),
            )
        })
        .collect()
}

/// Keys are slices of the shard's bytes (no allocation per sample), long ones too (GNU
/// long-name records); a non-UTF-8 name gets an owned, lossy key, as before.
#[test]
fn keys_borrow_the_shard_bytes() {
    let long = format!("{}/k", "d".repeat(150));
    let data = tar_of(&[
        ("a1.jpg", b"x"),
        ("a1.CLS", b"7"),
        (&format!("{long}.txt"), b"t"),
    ]);
    let url: Arc<str> = Arc::from("u");
    let samples = parse(&data, &url).unwrap();
    let inside = |k: &Key| {
        let at = k.bytes().as_ptr() as usize;
        at >= data.as_ptr() as usize && at + k.bytes().len() <= data.as_ptr() as usize + data.len()
    };
    assert_eq!(
        keys_and_fields(&samples),
        [
            ("a1".to_string(), vec!["jpg".to_string(), "cls".to_string()]),
            (long.clone(), vec!["txt".to_string()])
        ]
    );
    assert!(samples.iter().all(|s| inside(&s.key)));
    use std::os::unix::ffi::OsStrExt;
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1);
    h.set_entry_type(tar::EntryType::Regular);
    let name = std::ffi::OsStr::from_bytes(b"b\xff.jpg");
    b.append_data(&mut h, name, &b"x"[..]).unwrap();
    let raw = b.into_inner().unwrap();
    let odd = parse(&ShardBytes::heap(Bytes::from(raw)), &url).unwrap();
    assert_eq!(odd[0].key, "b\u{fffd}");
    assert!(!inside(&odd[0].key));
}

/// A key equals exactly its own text, however the text is held (`str`, `String`, `&str`).
#[test]
fn keys_compare_by_their_text() {
    let key = Key::from("a1");
    for (text, equal) in [
        ("a1", true),
        ("a2", false),
        ("a", false),
        ("a1 ", false),
        ("", false),
    ] {
        let owned: String = text.into();
        assert_eq!(
            (key == *text, key == owned, key == text),
            (equal, equal, equal),
            "{text:?}"
        );
    }
}

#[test]
fn split_name_matches_webdataset_regex() {
    // Expected values computed with webdataset.tariterators.base_plus_ext.
    let cases: &[(&str, Option<(&str, &str)>)] = &[
        ("a.jpg", Some(("a", "jpg"))),
        ("dir/a.seg.png", Some(("dir/a", "seg.png"))),
        ("d.x/y/a.b.c", Some(("d.x/y/a", "b.c"))),
        ("a.b/c.d.e", Some(("a.b/c", "d.e"))),
        ("dir/.hidden", Some(("dir/", "hidden"))),
        ("x/dir/.h.j", Some(("x/dir/", "h.j"))),
        ("x.y/.h", None),
        (".hidden", None),
        ("noext", None),
        ("a.b/noext", None),
        ("a.", Some(("a", ""))),
        ("a//.x", Some(("a//", "x"))),
        ("x/y.z/w/.q", Some(("x/y.z/w/", "q"))),
        // A directory ending in a dot, a name starting with a slash.
        ("a./b.c", Some(("a./b", "c"))),
        ("x/y./.z", None),
        ("a./b", None),
        ("/a.b", Some(("/a", "b"))),
        ("a/.b/c.d", Some(("a/.b/c", "d"))),
        // Newlines: `.` does not match one (issue 8, found by the tar fuzz target).
        ("30 path=a/very/long/name.jpg\n0/k.jpg", None),
        ("a\nb/c.d", Some(("a\nb/c", "d"))),
        ("a/b\nc/d.e", Some(("a/b\nc/d", "e"))),
        ("x.y\n/z.w", None),
        ("a/b.c\n", Some(("a/b", "c\n"))),
        ("d\n/.e", Some(("d\n/", "e"))),
        ("a/\n/.e", Some(("a/\n/", "e"))),
        ("a.b/c\nd.e", Some(("a.b/c\nd", "e"))),
        ("a\n.b", Some(("a\n", "b"))),
        ("\n/x.y", Some(("\n/x", "y"))),
        ("a/b/c\nd/e.f", Some(("a/b/c\nd/e", "f"))),
    ];
    for (name, want) in cases {
        assert_eq!(split_name(name), *want, "{name}");
    }
}

#[test]
fn meta_names_match_webdataset() {
    // Expected values computed with webdataset's tar_file_iterator rules.
    for (name, meta) in [
        ("__x.y__\n", true),
        ("__x__\n", true),
        ("__a.b__", true),
        ("__\n__/x.jpg", true),
        ("__x.y__\nz", false),
        ("__a__\n/b.c", false),
        ("___.x", false),
        ("__", true),
        ("__index__/x.json", true),
    ] {
        assert_eq!(is_meta(name), meta, "{name:?}");
    }
}

#[test]
fn groups_consecutive_members() {
    let data = tar_of(&[
        ("d.v1/s0.jpg", b"J0"),
        ("d.v1/s0.CLS", b"0"),
        ("d.v1/s0.seg.png", b"P0"),
        ("d.v1/s1.jpg", b"J1"),
        ("__meta__", b"m"),
        ("__index__/x.json", b"i"),
        ("README", b"skipped: no dot"),
        ("d.v1/s2.cls", b"2"),
    ]);
    let url: Arc<str> = Arc::from("gs://b/s.tar");
    let samples = parse(&data, &url).unwrap();
    assert_eq!(
        keys_and_fields(&samples),
        vec![
            (
                "d.v1/s0".into(),
                vec!["jpg".into(), "cls".into(), "seg.png".into()]
            ),
            ("d.v1/s1".into(), vec!["jpg".into()]),
            ("d.v1/s2".into(), vec!["cls".into()]),
        ]
    );
    assert_eq!(&samples[0].fields[2].1[..], b"P0");
    assert_eq!(&*samples[2].url, "gs://b/s.tar");
}

#[test]
fn long_names_gnu_and_pax() {
    let long_dir = "x".repeat(150);
    let gnu_name = format!("{long_dir}/sample.json");
    let gnu = tar_of(&[(gnu_name.as_str(), b"{}")]);
    let s = parse(&gnu, &Arc::from("u")).unwrap();
    assert_eq!(s[0].key, format!("{long_dir}/sample"));

    let mut b = tar::Builder::new(Vec::new());
    let pax_name = format!("{}/y.txt", "p".repeat(200));
    b.append_pax_extensions([("path", pax_name.as_bytes())])
        .unwrap();
    let mut h = tar::Header::new_ustar();
    h.set_size(3);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_path("short.txt").unwrap();
    h.set_cksum();
    b.append(&h, &b"abc"[..]).unwrap();
    let pax = ShardBytes::heap(Bytes::from(b.into_inner().unwrap()));
    let s = parse(&pax, &Arc::from("u")).unwrap();
    assert_eq!(s[0].key, format!("{}/y", "p".repeat(200)));
    assert_eq!(&s[0].fields[0].1[..], b"abc");
}

/// Issue 8: a header whose checksum is the signed-char sum (old Sun/NeXT tars) was
/// refused, though Python's `tarfile` (`calc_chksums`) and so webdataset read it.
#[test]
fn signed_checksum_headers_are_read() {
    let name = "données/été.jpg"; // bytes of 0x80 and up: the two sums differ
    let mut h = tar::Header::new_ustar();
    h.set_path(name).unwrap();
    h.set_size(5);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    let block = h.as_bytes().to_vec();
    let rest = || block[..148].iter().chain(&block[156..]);
    let unsigned: i64 = 256 + rest().map(|b| *b as i64).sum::<i64>();
    let signed: i64 = 256 + rest().map(|b| *b as i8 as i64).sum::<i64>();
    assert!(signed > 0 && signed != unsigned);
    let with_cksum = |sum: i64| {
        let mut b = block.clone();
        b[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        b.extend_from_slice(b"hello");
        b.resize(512 + 512 + 1024, 0);
        ShardBytes::heap(Bytes::from(b))
    };
    let url: Arc<str> = Arc::from("gs://b/sun.tar");
    for sum in [unsigned, signed] {
        let s = parse(&with_cksum(sum), &url).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].key, "données/été");
        assert_eq!(&*s[0].fields[0].0, "jpg");
        assert_eq!(&s[0].fields[0].1[..], b"hello");
    }
    // Any other value is still a bad header.
    let err = parse(&with_cksum(signed + 1), &url)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "gs://b/sun.tar: not a valid tar file: archive header checksum mismatch"
    );
}

/// A header block as a tar writer that is not the `tar` crate may lay it out.
fn raw(name: &str, size: u64, kind: tar::EntryType) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
    h.set_size(size);
    h.set_mode(0o644);
    h.set_entry_type(kind);
    h.set_cksum();
    h.as_bytes().to_vec()
}

/// `b` padded to whole blocks.
fn padded(b: &[u8]) -> Vec<u8> {
    let mut b = b.to_vec();
    b.resize(b.len().next_multiple_of(512), 0);
    b
}

/// Issue 8 (fuzzing, `tar` target against its reference walk): a PAX `size` record
/// followed by a GNU long-name header was applied to the long-name header, so the shard
/// silently yielded no samples, where tarfile (webdataset) reads the file with the PAX size.
#[test]
fn pax_size_describes_the_member_after_a_long_name() {
    let long = format!("dir/{}.jpg", "n".repeat(120));
    let mut data = raw("pax", 10, tar::EntryType::XHeader);
    data.extend(padded(b"10 size=5\n"));
    data.extend(raw(
        "././@LongLink",
        long.len() as u64 + 1,
        tar::EntryType::GNULongName,
    ));
    data.extend(padded(format!("{long}\0").as_bytes()));
    data.extend(raw("short.jpg", 999, tar::EntryType::Regular)); // PAX says 5
    data.extend(padded(b"hello"));
    data.extend([0u8; 1024]);
    let s = parse(&ShardBytes::heap(Bytes::from(data)), &Arc::from("u")).unwrap();
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].key, format!("dir/{}", "n".repeat(120)));
    assert_eq!(&s[0].fields[0].1[..], b"hello");
}

/// Issue 8 (fuzzing, `tar` target against its reference walk): a PAX path holding a
/// newline was refused ("malformed pax extension": the `tar` crate splits records at
/// newlines), though PAX records are length-prefixed for this and tarfile reads them.
#[test]
fn pax_records_are_read_by_length() {
    let pax = |records: &[u8]| {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        h.set_size(records.len() as u64);
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_cksum();
        b.append(&h, records).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(3);
        h.set_path("short.txt").unwrap();
        h.set_cksum();
        b.append(&h, &b"abc"[..]).unwrap();
        parse(
            &ShardBytes::heap(Bytes::from(b.into_inner().unwrap())),
            &Arc::from("u"),
        )
    };
    // A record's length counts the whole record, its own digits included.
    let s = pax(b"16 path=a\nb/c.d\n").unwrap();
    assert_eq!(s[0].key, "a\nb/c");
    assert_eq!(&s[0].fields[0].1[..], b"abc");
    // Padding after the records ends them, as in tarfile.
    let s = pax(b"16 path=x/y.bin\n\0\0\0\0").unwrap();
    assert_eq!((s[0].key.as_str(), &*s[0].fields[0].0), ("x/y", "bin"));
    // So does anything that does not start a record (`\d+ `): digits without their space, a
    // space without digits.
    for padding in [&b"12ab"[..], b" 12 x", b"7"] {
        let mut records = b"16 path=x/y.bin\n".to_vec();
        records.extend_from_slice(padding);
        let s = pax(&records).unwrap();
        assert_eq!(s[0].key.as_str(), "x/y", "{padding:?}");
    }
    for (records, why) in [
        // Shorter than its digits, a space and a newline.
        (
            &b"2 =\n"[..],
            "a PAX record's length does not fit its header",
        ),
        (
            b"99 path=x/y.bin\n",
            "a PAX record's length does not fit its header",
        ),
        (
            b"0 path=x\n",
            "a PAX record's length does not fit its header",
        ),
        (b"17 path=x/y.bin  ", "malformed PAX record"),
        (b"11 pathxxx\n", "malformed PAX record"),
        (b"11 size=+3\n", "invalid PAX size record"),
    ] {
        let err = pax(records).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("u: not a valid tar file: {why}"),
            "{records:?}"
        );
    }
}

#[test]
fn errors_name_the_shard() {
    let url: Arc<str> = Arc::from("gs://b/bad.tar");
    let dup = tar_of(&[("k.jpg", b"1"), ("k.JPG", b"2")]);
    let err = parse(&dup, &url).unwrap_err().to_string();
    assert!(
        err.contains("gs://b/bad.tar") && err.contains("duplicate field \"jpg\""),
        "{err}"
    );

    let garbage = ShardBytes::heap(Bytes::from(vec![0x5au8; 4096]));
    let err = parse(&garbage, &url).unwrap_err().to_string();
    assert!(
        err.starts_with("gs://b/bad.tar: not a valid tar file"),
        "{err}"
    );

    let err = parse(&ShardBytes::default(), &url).unwrap_err().to_string();
    assert_eq!(err, "gs://b/bad.tar: empty file, not a tar");

    // Sizes near u64::MAX (base-256 or PAX) must not wrap the walk around or panic.
    for size in [u64::MAX, u64::MAX - 511, 1 << 40] {
        let mut h = tar::Header::new_gnu();
        h.set_path("noext").unwrap();
        h.set_size(size);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        let mut data = h.as_bytes().to_vec();
        data.extend_from_slice(&[0u8; 1024]);
        let err = parse(&ShardBytes::heap(Bytes::from(data)), &url)
            .unwrap_err()
            .to_string();
        // The bytes needed saturate at u64::MAX rather than wrap.
        let needed = (512 + u128::from(size)).min(u128::from(u64::MAX));
        assert_eq!(
            err,
            format!(
                "gs://b/bad.tar: truncated: member \"noext\" needs bytes up to {needed}, \
                 the shard has 1536"
            ),
            "{size}"
        );
    }
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("size", u64::MAX.to_string().as_bytes())])
        .unwrap();
    let mut h = tar::Header::new_ustar();
    h.set_size(3);
    h.set_path("k.txt").unwrap();
    h.set_cksum();
    b.append(&h, &b"abc"[..]).unwrap();
    let err = parse(
        &ShardBytes::heap(Bytes::from(b.into_inner().unwrap())),
        &url,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("truncated: member \"k.txt\""), "{err}");

    let whole = tar_of(&[("k.bin", &[7u8; 5000])]);
    let cut = whole.slice(..2048);
    let err = parse(&cut, &url).unwrap_err().to_string();
    assert!(err.contains("truncated"), "{err}");
}

#[test]
fn field_names_are_lowercased_as_webdataset_does_non_ascii_ones_too() {
    // webdataset lowercases a member's extension with Python's str.lower(): "JPG" and "ÉÈ"
    // (no ASCII letter in it at all) both.
    let url: Arc<str> = Arc::from("gs://b/x.tar");
    let shard = tar_of(&[("k.JPG", b"1"), ("k.ÉÈ", b"2"), ("k.txt", b"3")]);
    let samples = parse(&shard, &url).unwrap();
    assert_eq!(
        keys_and_fields(&samples),
        [(
            "k".to_owned(),
            vec!["jpg".to_owned(), "éè".to_owned(), "txt".to_owned()]
        )]
    );
    // A key reads as its text.
    assert_eq!(&*samples[0].key, "k");
    assert_eq!(samples[0].key.len(), 1);
}

#[test]
fn a_tar_may_end_after_one_zero_block_but_not_inside_a_header() {
    let url: Arc<str> = Arc::from("gs://b/x.tar");
    let whole = tar_of(&[("k.txt", b"abc")]);
    // A member's header and its data block, then the end: one zero block (of tar's two)
    // is enough, as for tar and tarfile.
    let one_zero_block = ShardBytes::heap(Bytes::copy_from_slice(&whole[..3 * 512]));
    assert_eq!(
        keys_and_fields(&parse(&one_zero_block, &url).unwrap()),
        [("k".to_owned(), vec!["txt".to_owned()])]
    );
    // Bytes after the member that are less than a header block.
    let mut cut = whole[..2 * 512].to_vec();
    cut.extend_from_slice(&[7; 100]);
    let err = parse(&ShardBytes::heap(Bytes::from(cut)), &url)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the archive ends inside a header block"),
        "{err}"
    );
}

/// A PAX `size` record describes the member, not the extension headers between it and the
/// member (a long link name, another PAX header: each is read with its own size), as tarfile
/// (webdataset) reads them.
#[test]
fn pax_size_skips_every_kind_of_extension_header() {
    for (kind, body) in [
        (tar::EntryType::GNULongLink, b"some/link/target\0".to_vec()),
        (tar::EntryType::XHeader, b"18 path=dir/k.jpg\n".to_vec()),
        (
            tar::EntryType::XGlobalHeader,
            b"18 comment=global\n".to_vec(),
        ),
    ] {
        let mut data = raw("pax", 10, tar::EntryType::XHeader);
        data.extend(padded(b"10 size=5\n"));
        data.extend(raw("ext", body.len() as u64, kind));
        data.extend(padded(&body));
        data.extend(raw("dir/k.jpg", 999, tar::EntryType::Regular)); // PAX says 5
        data.extend(padded(b"hello"));
        data.extend([0u8; 1024]);
        let s = parse(&ShardBytes::heap(Bytes::from(data)), &Arc::from("u")).unwrap();
        assert_eq!(
            keys_and_fields(&s),
            [("dir/k".to_owned(), vec!["jpg".to_owned()])],
            "{kind:?}"
        );
        assert_eq!(&s[0].fields[0].1[..], b"hello", "{kind:?}");
    }
}

#[test]
fn a_member_cut_short_is_truncated_and_one_that_ends_the_file_exactly_is_whole() {
    let url: Arc<str> = Arc::from("gs://b/x.tar");
    let whole = tar_of(&[("k.bin", &[7u8; 1000])]);
    // 600 of its 1000 bytes.
    let err = parse(&whole.slice(..512 + 600), &url)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "gs://b/x.tar: truncated: member \"k.bin\" needs bytes up to 1512, the shard has 1112"
    );
    // A member whose last byte is the file's last (no padding, no end blocks): whole.
    let exact = tar_of(&[("k.bin", &[7u8; 512])]);
    let s = parse(&exact.slice(..1024), &url).unwrap();
    assert_eq!(&s[0].fields[0].1[..], &[7u8; 512][..]);
}
