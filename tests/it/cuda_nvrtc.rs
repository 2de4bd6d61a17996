//! Every kernel compiles through NVRTC for sm_80 and sm_90 and assembles with `ptxas`; the
//! register and spill counts per kernel are printed. No GPU needed: NVRTC and ptxas come from the
//! PyPI wheels that `scripts/ci/cuda.sh setup` installs. With `KVGUARD_REQUIRE_NVRTC=1` a missing
//! NVRTC or ptxas fails the test instead of skipping it.

/// Under `cuda::` so that `cargo test cuda` selects these.
mod cuda {
    use kvguard::cuda::DeviceError;
    use kvguard::cuda::source::{self, KERNELS};
    use std::path::PathBuf;
    use std::process::Command;

    fn required() -> bool {
        std::env::var("KVGUARD_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
    }

    /// Skips loudly, or fails when the tools are required.
    fn skip(why: &str) {
        assert!(!required(), "KVGUARD_REQUIRE_NVRTC=1 but {why}");
        crate::common::skip::skipped(&format!("{why} (set up with `source scripts/ci/cuda.sh setup`)"));
    }

    fn ptxas() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("KVGUARD_PTXAS") {
            return Some(PathBuf::from(p));
        }
        std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("ptxas")).find(|p| p.is_file())
    }

    /// One kernel's resource use as ptxas reports it.
    #[derive(Debug, Default)]
    struct Usage {
        registers: u32,
        stack: u32,
        spill_stores: u32,
        spill_loads: u32,
        smem: u32,
    }

    /// Parses `ptxas -v` output into (kernel, usage) in report order.
    fn parse_ptxas(log: &str) -> Vec<(String, Usage)> {
        let mut out: Vec<(String, Usage)> = Vec::new();
        let num_before = |line: &str, word: &str| -> u32 {
            let at = line.find(word).unwrap_or(0);
            line[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or(0)
        };
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let name = rest.split('\'').next().unwrap_or_default().to_string();
                out.push((name, Usage::default()));
            } else if let Some((_, u)) = out.last_mut() {
                if line.contains("bytes stack frame") {
                    u.stack = num_before(line, "bytes stack frame");
                    u.spill_stores = num_before(line, "bytes spill stores");
                    u.spill_loads = num_before(line, "bytes spill loads");
                } else if line.contains("Used") && line.contains("registers") {
                    u.registers = num_before(line, "registers");
                    if line.contains("bytes smem") {
                        u.smem = num_before(line, "bytes smem");
                    }
                }
            }
        }
        out
    }

    #[test]
    fn kernels_compile_with_nvrtc_for_sm80_and_sm90_and_assemble_with_ptxas() {
        if !source::nvrtc_available() {
            skip("NVRTC (libnvrtc.so.12) is not on LD_LIBRARY_PATH");
            return;
        }
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvguard-nvrtc");
        std::fs::create_dir_all(&dir).unwrap();
        let mut ptx_files = Vec::new();
        for (virt, real) in [("compute_80", "sm_80"), ("compute_90", "sm_90")] {
            let ptx = source::compile_ptx(virt).unwrap_or_else(|e| panic!("NVRTC failed for {virt}:\n{e}"));
            for k in KERNELS {
                assert!(ptx.contains(&format!(".entry {k}(")), "{virt}: kernel {k} missing from the PTX");
            }
            let path = dir.join(format!("kvguard_{real}.ptx"));
            std::fs::write(&path, ptx.as_bytes()).unwrap();
            ptx_files.push((real, path));
        }

        let Some(ptxas) = ptxas() else {
            skip("ptxas was not found (KVGUARD_PTXAS or PATH)");
            return;
        };
        for (arch, ptx) in &ptx_files {
            let cubin = ptx.with_extension("cubin");
            let run = Command::new(&ptxas)
                .args(["-arch", arch, "-v", "-o"])
                .arg(&cubin)
                .arg(ptx)
                .output()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
            let log = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
            assert!(run.status.success() && !log.contains("error"), "ptxas failed for {arch}:\n{log}");
            let usage = parse_ptxas(&log);
            println!(
                "\nptxas {arch}: {:<34} {:>5} {:>6} {:>7} {:>7} {:>6}",
                "kernel", "regs", "stack", "spill-st", "spill-ld", "smem"
            );
            for (name, u) in &usage {
                println!(
                    "ptxas {arch}: {name:<34} {:>5} {:>6} {:>7} {:>7} {:>6}",
                    u.registers, u.stack, u.spill_stores, u.spill_loads, u.smem
                );
            }
            for k in KERNELS {
                let u = usage.iter().find(|(n, _)| n == k).map(|(_, u)| u);
                let u = u.unwrap_or_else(|| panic!("ptxas {arch} did not report kernel {k}:\n{log}"));
                assert!(u.registers > 0 && u.registers <= 255, "{arch} {k}: {} registers", u.registers);
            }
            // The check path (verify, fused attention, tag updates) must not spill.
            for k in [
                "kvg_verify_block_table",
                "kvg_verify_paged_kv",
                "kvg_verify_token_rows",
                "kvg_decode_attention_checked",
                "kvg_apply_tag_updates",
            ] {
                let u = &usage.iter().find(|(n, _)| n == k).unwrap().1;
                assert_eq!((u.spill_stores, u.spill_loads), (0, 0), "{arch} {k} spills");
            }
        }
    }

    #[test]
    fn kernels_compile_to_cubins_for_sm80_and_sm90() {
        if !source::nvrtc_available() {
            skip("NVRTC (libnvrtc.so.12) is not on LD_LIBRARY_PATH");
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let cubin = source::compile_cubin(arch).unwrap_or_else(|e| panic!("NVRTC failed for {arch}:\n{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: a CUBIN is an ELF image");
            source::check_cubin(&cubin).unwrap_or_else(|e| panic!("{arch}: NVRTC's CUBIN fails the load check: {e}"));
            assert_eq!(source::cubin_arch(&cubin).as_deref(), Some(arch), "the architecture in its ELF flags");
            for k in KERNELS.iter().copied().chain([source::fingerprint_kernel().as_str()]) {
                let name = k.as_bytes();
                assert!(cubin.windows(name.len()).any(|w| w == name), "{arch}: kernel {k} missing from the CUBIN");
            }
        }
    }

    #[test]
    fn an_unknown_architecture_is_a_typed_compile_error() {
        if !source::nvrtc_available() {
            skip("NVRTC (libnvrtc.so.12) is not on LD_LIBRARY_PATH");
            return;
        }
        match source::compile_ptx("compute_1") {
            Err(DeviceError::Compile { arch, log }) => {
                assert_eq!(arch, "compute_1");
                assert!(!log.is_empty());
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn the_nvrtc_source_inlines_the_header_once() {
        let src = source::nvrtc_source();
        assert!(!src.lines().any(|l| l.starts_with("#include \"kvguard.cuh\"")));
        assert_eq!(src.matches("#define KVGUARD_CUH").count(), 1);
        for k in KERNELS {
            assert!(src.contains(&format!("{k}(")), "{k} not defined");
        }
    }

    /// Engines that fuse the checks include `kvguard.cuh` in several `.cu` files and may link them
    /// with relocatable device code (`-rdc`): the header must define no symbol with external
    /// linkage, or the device link sees each twice. Each unit's PTX, compiled relocatable, must
    /// keep the CRC constant table internal (no `.visible`) and declare nothing `.extern`.
    #[test]
    fn the_header_defines_no_external_symbol_under_rdc() {
        if !source::nvrtc_available() {
            skip("NVRTC (libnvrtc.so.12) is not on LD_LIBRARY_PATH");
            return;
        }
        let header = include_str!("../../kernels/kvguard.cuh");
        for unit in ["a", "b"] {
            let src = format!(
                "{header}\nextern \"C\" __global__ void engine_{unit}(uint32_t *out, uint32_t crc, uint64_t n) {{\n\
                     out[0] = kvg_crc32_combine(crc, out[1], n);\n}}\n"
            );
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec!["--gpu-architecture=compute_90".into(), "--relocatable-device-code=true".into()],
                name: Some(format!("engine_{unit}.cu")),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts)
                .unwrap_or_else(|e| panic!("the header does not compile relocatable: {e:?}"))
                .to_src();
            let table: Vec<&str> = ptx.lines().filter(|l| l.contains("kvg_crc32_x2n[")).collect();
            assert!(!table.is_empty(), "unit {unit}: the CRC table is not in the PTX:\n{ptx}");
            for line in table.iter().chain(ptx.lines().filter(|l| l.contains(".extern")).collect::<Vec<_>>().iter()) {
                assert!(
                    !line.contains(".visible") && !line.contains(".extern"),
                    "unit {unit}: an external symbol would be defined twice under -rdc: {line}"
                );
            }
        }
    }
}
