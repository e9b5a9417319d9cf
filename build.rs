//! Compiles the Python client's decoder (clients/python/native/decode.rs) into OUT_DIR as
//! libshardd_decode.so, which the wheel carries in the `shardd` package (pyproject.toml,
//! `include ... from = "out-dir"`). It is not part of the daemon: a separate shared library,
//! built with this build's rustc and target, no dependencies.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "clients/python/native/decode.rs";

fn main() {
    println!("cargo::rerun-if-changed={SOURCE}");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let rustc = env::var_os("RUSTC").expect("cargo sets RUSTC");
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let status = Command::new(rustc)
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
        .arg(out.join("libshardd_decode.so"))
        .arg(SOURCE)
        .status()
        .expect("running rustc for the client's decoder");
    assert!(status.success(), "rustc failed to compile {SOURCE}");
}
