//! The checked-in header is what cbindgen makes of the crate now. `KVGUARD_BLESS=1` rewrites it.

use std::path::Path;

#[test]
fn the_committed_header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen understands the crate");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include/kvguard.h");
    if std::env::var_os("KVGUARD_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("include/kvguard.h is writable");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "bindings/c/include/kvguard.h is stale: regenerate it with `KVGUARD_BLESS=1 cargo test -p kvguard-c --test header` and commit it"
    );
}

/// The `kvg_`/`KVG_` words of a C source.
fn kvg_names(source: &str) -> std::collections::BTreeSet<&str> {
    source
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("kvg_") || w.starts_with("KVG_"))
        .collect()
}

/// An engine's C++ file may include both this header and the device header
/// (`kernels/kvguard.cuh`, which needs CUDA to compile): no name may mean two things.
#[test]
fn the_header_shares_no_name_with_the_device_header() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let host = std::fs::read_to_string(crate_dir.join("include/kvguard.h")).expect("the header is readable");
    let device =
        std::fs::read_to_string(crate_dir.join("../../kernels/kvguard.cuh")).expect("the device header is readable");
    let shared: Vec<_> = kvg_names(&host).intersection(&kvg_names(&device)).copied().collect();
    assert!(shared.is_empty(), "names in both kvguard.h and kvguard.cuh: {shared:?}");
}
