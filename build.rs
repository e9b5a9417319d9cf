//! Compiles the Python client's decoder (clients/python/native/decode.rs) into OUT_DIR as
//! libshardd_decode.so, which the wheel carries in the `shardd` package (pyproject.toml,
//! `include ... from = "out-dir"`). It is not part of the daemon: a separate shared library,
//! built with this build's rustc, target and linker, no dependencies. If it cannot be built
//! the daemon still is (a warning says so): the client then decodes in Python, and
//! tests/python/test_wheel.py fails for a wheel without it.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "clients/python/native/decode.rs";

fn main() {
    println!("cargo::rerun-if-changed={SOURCE}");
    let (Some(out), Some(rustc), Ok(target)) = (
        env::var_os("OUT_DIR"),
        env::var_os("RUSTC"),
        env::var("TARGET"),
    ) else {
        println!("cargo::warning=no OUT_DIR, RUSTC or TARGET: the client's decoder is not built");
        return;
    };
    let mut rustc = Command::new(rustc);
    rustc
        .args([
            "--edition=2024",
            "--crate-type=cdylib",
            "--crate-name=shardd_decode",
        ])
        .args([
            "-C",
            "opt-level=3",
            "-C",
            "panic=abort",
            "-C",
            "strip=debuginfo",
        ])
        .args(["--target", &target, "-o"])
        .arg(PathBuf::from(out).join("libshardd_decode.so"))
        .arg(SOURCE);
    if let Some(linker) = env::var_os("RUSTC_LINKER") {
        rustc.arg("-C").arg({
            let mut flag = std::ffi::OsString::from("linker=");
            flag.push(linker);
            flag
        });
    }
    match rustc.status() {
        Ok(status) if status.success() => {}
        result => println!(
            "cargo::warning=the client's decoder ({SOURCE}) was not built ({result:?}): \
             the wheel's client will decode in Python"
        ),
    }
}
