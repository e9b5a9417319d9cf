use super::*;

const MINIMAL: &str = r#"
    [datasets.train]
    shards = "/data/train-{0..3}.tar"
"#;

#[test]
fn defaults_apply() {
    let c = Config::parse(MINIMAL, Path::new("/etc/shardd")).unwrap();
    assert_eq!(c.socket, PathBuf::from("/run/shardd/shardd.sock"));
    assert_eq!(c.socket_mode, 0o660);
    // "auto": 80% of the free space of the cache's file system (or its nearest parent).
    assert_eq!(c.cache_max_share, Some(0.8));
    assert!(c.cache_max_bytes > 0);
    assert_eq!(c.host, Topology { index: 0, count: 1 });
    let d = &c.datasets["train"];
    assert_eq!(d.shuffle_buffer, 10_000);
    assert_eq!(d.shards.len(), 4);
    assert_eq!(d.shards[3].as_str(), "/data/train-3.tar");
}

/// config.example.toml claims to show every default: hold it to that.
#[test]
fn example_config_shows_the_defaults() {
    let text = include_str!("../../config.example.toml");
    let mut example = Config::parse(text, Path::new("/etc/shardd")).unwrap();
    let defaults = Config::parse(
        "[datasets.train]\nshards = \"gs://bucket/imagenet/train-{000000..000639}.tar\"",
        Path::new("/etc/shardd"),
    )
    .unwrap();
    // max_size = "auto" is a share of the free space, which may change between two reads.
    assert_eq!(example.cache_max_share, defaults.cache_max_share);
    example.cache_max_bytes = defaults.cache_max_bytes;
    example.zero_copy_bytes = defaults.zero_copy_bytes;
    assert_eq!(format!("{example:?}"), format!("{defaults:?}"));
    // The commented-out sections parse too, with the values they show.
    let uncommented: String = text
        .lines()
        .map(|l| {
            l.strip_prefix('#')
                .filter(|r| !r.starts_with([' ', '#']) && !r.is_empty())
                .unwrap_or(l)
        })
        .collect::<Vec<_>>()
        .join("\n");
    let full = Config::parse(&uncommented, Path::new("/etc/shardd")).unwrap();
    assert_eq!(
        full.gcs.as_ref().unwrap().endpoint.as_deref(),
        Some("http://127.0.0.1:4443")
    );
    assert_eq!(
        full.gcs.as_ref().unwrap().credentials.as_deref(),
        Some(Path::new("/etc/shardd/gcs-key.json"))
    );
    assert_eq!(full.s3.unwrap().region.as_deref(), Some("us-east-1"));
    let blend = &full.mixes["blend"];
    let weights = |epoch| blend.epoch_mix(epoch, 1).segments()[0].weights.clone();
    assert_eq!((weights(9), weights(10)), (vec![1, 3], vec![1, 1]));
}

#[test]
fn unknown_keys_are_errors() {
    let text = format!("{MINIMAL}\n[cache]\nmax_sise = \"1GiB\"\n");
    let err = Config::parse(&text, Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `max_sise`"), "{err}");
}

#[test]
fn bad_values_name_the_key() {
    for (extra, expect) in [
        ("[cache]\nmax_size = \"lots\"", "cache.max_size"),
        (
            "[host]\nindex = 2\ncount = 2",
            "host.index 2 must be less than host.count 2",
        ),
        ("[server]\nsocket_mode = \"0999\"", "server.socket_mode"),
        ("[store]\nread_timeout = \"soon\"", "store.read_timeout"),
        (
            "[store]\nverify = \"md5\"",
            "store.verify \"md5\" is none of \"auto\", \"size\", \"checksum\"",
        ),
        ("[store]\nretry_timeout = \"0s\"", "store.retry_timeout"),
        (
            "[datasets.g]\nshards = \"data/train-*.tar\"",
            "dataset \"g\": shards \"data/train-*.tar\" is a glob, which shardd does not expand (it lists no directory or bucket); name the shards with braces, e.g. \"data/train-{000000..000099}.tar\"",
        ),
        (
            "[datasets.g]\nshards = \"gs://bucket/train/\"",
            "shards \"gs://bucket/train/\" is a directory, not a shard",
        ),
        (
            "[store]\nmax_requests_per_second = -5",
            "store.max_requests_per_second must be a number of requests per second, 0 for no ceiling, not -5",
        ),
        (
            "[store]\ncredentials_timeout = \"x\"",
            "store.credentials_timeout",
        ),
        (
            "[gcs]\ncredentials = \"k.json\"\nanonymous = true",
            "gcs.credentials and gcs.anonymous = true contradict each other",
        ),
        (
            "[cache]\nblock_size = \"1MB\"",
            "cache.block_size must be a power of two from 64KiB to 2MiB, not \"1MB\"",
        ),
        ("[cache]\nblock_size = \"32KiB\"", "from 64KiB to 2MiB"),
        ("[cache]\nblock_size = \"4MiB\"", "from 64KiB to 2MiB"),
        ("[cache]\nblock_size = \"big\"", "cache.block_size"),
        (
            "[host]\nindex = -1",
            "invalid value: integer `-1`, expected a whole number from 0, \"auto\" or \"from-clients\"",
        ),
        (
            "[host]\ncount = 1.5",
            "invalid type: floating point `1.5`, expected a whole number from 0",
        ),
        (
            "[host]\ncount = 4294967296",
            "invalid value: integer `4294967296`, expected a whole number",
        ),
        (
            "[datasets.g]\nshards = \"gs:/bucket/x.tar\"",
            "dataset \"g\": gs:/bucket/x.tar: a gs:// URL needs two slashes: did you mean \"gs://bucket/x.tar\"?",
        ),
    ] {
        let text = format!("{MINIMAL}\n{extra}\n");
        let err = Config::parse(&text, Path::new("."))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{extra}: {err}");
    }
}

/// Issue 8: absurd durations panicked in `Duration::from_secs_f64`, and a zero timeout
/// was accepted (every handshake, stall or space wait would fail at once).
#[test]
fn absurd_and_zero_durations_are_refused_naming_the_key() {
    for (extra, expect) in [
        (
            "[server]\nstall_timeout = \"99999999999999999999999h\"",
            "invalid config: server.stall_timeout \"99999999999999999999999h\" is too long",
        ),
        (
            "[cache]\nrevalidate = \"18446744073709551616s\"",
            "invalid config: cache.revalidate \"18446744073709551616s\" is too long",
        ),
        (
            "[cache]\nmax_size = \"99999999999999999999TiB\"",
            "invalid config: cache.max_size \"99999999999999999999TiB\" is too large",
        ),
    ] {
        let text = format!("{MINIMAL}\n{extra}\n");
        let err = Config::parse(&text, Path::new("."))
            .unwrap_err()
            .to_string();
        assert_eq!(err, expect);
    }
    for (section, key) in [
        ("server", "handshake_timeout"),
        ("server", "stall_timeout"),
        ("store", "connect_timeout"),
        ("store", "read_timeout"),
        ("cache", "space_timeout"),
    ] {
        for zero in ["0s", "0ms", "0.0000000001s"] {
            let text = format!("{MINIMAL}\n[{section}]\n{key} = \"{zero}\"\n");
            let err = Config::parse(&text, Path::new("."))
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                format!("invalid config: {section}.{key} \"{zero}\" must be longer than zero")
            );
        }
    }
    // revalidate = "0s" means "check the source before every use": allowed.
    let text = format!("{MINIMAL}\n[cache]\nrevalidate = \"0s\"\n");
    let c = Config::parse(&text, Path::new(".")).unwrap();
    assert_eq!(c.revalidate, Duration::ZERO);
    // The longest duration that fits is accepted (tokio treats it as "never").
    let text = format!("{MINIMAL}\n[server]\nstall_timeout = \"10000000000000000000s\"\n");
    let c = Config::parse(&text, Path::new(".")).unwrap();
    assert_eq!(
        c.stall_timeout,
        Duration::from_secs(10_000_000_000_000_000_000)
    );
}

#[test]
fn plain_http_endpoints_only_on_loopback_or_when_allowed() {
    let with = |section: &str| {
        Config::parse(&format!("{MINIMAL}\n{section}\n"), Path::new("."))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(with("[gcs]\nendpoint = \"http://127.0.0.1:4443\"").is_ok());
    assert!(with("[s3]\nendpoint = \"http://localhost:9000\"").is_ok());
    assert!(with("[gcs]\nendpoint = \"https://storage.example.com\"").is_ok());
    assert!(with("[s3]\nendpoint = \"http://minio.lan:9000\"\nallow_http = true").is_ok());
    let err = with("[s3]\nendpoint = \"http://minio.lan:9000\"").unwrap_err();
    assert_eq!(
        err,
        "invalid config: s3.endpoint \"http://minio.lan:9000\" is plain http: credentials would travel in clear text; use https, a loopback address, or set s3.allow_http = true"
    );
}

#[test]
fn duplicate_shards_are_refused() {
    let text = r#"
        [datasets.d]
        shards = ["/x/a-{0..2}.tar", "/x/a-2.tar"]
    "#;
    let err = Config::parse(text, Path::new(".")).unwrap_err().to_string();
    assert!(err.contains("/x/a-2.tar is listed twice"), "{err}");
}

#[test]
fn sizes_and_durations() {
    assert_eq!(parse_size("100GiB", "k").unwrap(), 100 << 30);
    assert_eq!(parse_size("1.5 MB", "k").unwrap(), 1_500_000);
    assert_eq!(parse_size("4096", "k").unwrap(), 4096);
    assert!(parse_size("-1GiB", "k").is_err());
    assert_eq!(
        parse_duration("500ms", "k").unwrap(),
        Duration::from_millis(500)
    );
    assert_eq!(parse_duration("2m", "k").unwrap(), Duration::from_secs(120));
    assert!(parse_duration("10", "k").is_err());
}

/// Through f64, "8.2 GB" was 8_199_999_999 bytes and "1.005kB" 1004.
#[test]
fn sizes_are_exact_and_case_insensitive() {
    assert_eq!(parse_size("8.2 GB", "k").unwrap(), 8_200_000_000);
    assert_eq!(parse_size("1.005kB", "k").unwrap(), 1005);
    assert_eq!(parse_size("0.1gib", "k").unwrap(), 107_374_182);
    assert_eq!(parse_size(" 64MiB ", "k").unwrap(), 64 << 20);
    for bad in ["", "GiB", "5 GiBs", "-1"] {
        let err = parse_size(bad, "k").unwrap_err().to_string();
        assert!(err.contains("is not a size like"), "{bad:?}: {err}");
    }
}

#[test]
fn the_cache_block_size_defaults_to_2_mib_and_takes_powers_of_two_down_to_64_kib() {
    let block = |extra: &str| {
        Config::parse(&format!("{MINIMAL}\n{extra}\n"), Path::new("."))
            .unwrap()
            .cache_block_size
    };
    assert_eq!(block(""), 2 << 20);
    assert_eq!(block("[cache]\nblock_size = \"64KiB\""), 64 << 10);
    assert_eq!(block("[cache]\nblock_size = \"512KiB\""), 512 << 10);
}
