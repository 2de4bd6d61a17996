//! The kernel sources, embedded, and their compilation through NVRTC (compiled once per
//! architecture and process, then cached), or a CUBIN built ahead of time and checked before the
//! driver reads it.

use super::error::{DeviceError, panic_message};
use super::nvrtc;
use crate::le;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `kernels/kvguard.cuh`: the device API engines include to fuse the checks into their kernels.
pub const KVGUARD_CUH: &str = include_str!("../../kernels/kvguard.cuh");
/// `kernels/kvguard.cu`: kvguard's own kernels.
pub const KVGUARD_CU: &str = include_str!("../../kernels/kvguard.cu");

/// Every `extern "C"` kernel in `kvguard.cu`.
pub const KERNELS: &[&str] = &[
    "kvg_apply_tag_updates",
    "kvg_verify_block_table",
    "kvg_verify_paged_kv",
    "kvg_verify_token_rows",
    "kvg_store_kv_b32",
    "kvg_store_kv_b16",
    "kvg_verify_slot_mapping",
    "kvg_fence_refused",
    "kvg_crc32_pages",
    "kvg_scrub_pages",
    "kvg_decode_attention_unchecked",
    "kvg_decode_attention_checked",
    "kvg_decode_attention_checked_canary",
    "kvg_decode_attention_unchecked_bf16",
    "kvg_decode_attention_checked_bf16",
    "kvg_decode_attention_checked_canary_bf16",
];

/// One translation unit for NVRTC: `kvguard.cu` with `kvguard.cuh` inlined where it is included,
/// so compiling needs no file system and no CUDA headers, followed by an empty kernel named
/// [`fingerprint_kernel`]: a prebuilt CUBIN that lacks it was built from other sources.
pub fn nvrtc_source() -> String {
    let unit = KVGUARD_CU.replacen("#include \"kvguard.cuh\"", KVGUARD_CUH, 1);
    format!(
        "{unit}\n// The sources' fingerprint (kvguard::cuda::source::fingerprint_kernel).\n\
         extern \"C\" __global__ void {}() {{}}\n",
        fingerprint_kernel()
    )
}

/// The name of the empty kernel that fingerprints the kernel sources: `kvg_source_` and the
/// 64-bit FNV-1a hash of `kvguard.cuh` and `kvguard.cu` in hex. A CUBIN loaded through
/// [`DeviceOptions::cubin`](super::DeviceOptions::cubin) must define it, so that kernels of another
/// kvguard version (other arguments, other layouts) are refused instead of launched.
pub fn fingerprint_kernel() -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in KVGUARD_CUH.bytes().chain([0]).chain(KVGUARD_CU.bytes()) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("kvg_source_{hash:016x}")
}

/// `EM_CUDA`: the ELF machine of a CUBIN.
const EM_CUDA: u16 = 190;

/// Checks that `image` is a CUBIN the driver can be handed: a 64-bit little-endian ELF image for
/// `EM_CUDA` whose program headers, section headers and section contents all lie inside `image`.
/// The driver reads the image without knowing its length, so anything else (a truncated file,
/// PTX, a fat binary, a host library) is refused here with [`DeviceError::Cubin`], before any
/// driver call. Whether it holds code for the device's architecture only the driver can tell.
pub fn check_cubin(image: &[u8]) -> Result<(), DeviceError> {
    let bad = |why: String| Err(DeviceError::Cubin(why));
    let u16_at = |at: usize| le::u16_at(image, at);
    let u32_at = |at: usize| le::u32_at(image, at);
    let u64_at = |at: usize| le::u64_at(image, at);
    if image.len() < 64 || &image[..4] != b"\x7fELF" {
        return bad(format!("{} bytes that are not an ELF image (a CUBIN is one)", image.len()));
    }
    if image[4] != 2 || image[5] != 1 {
        return bad("not a 64-bit little-endian ELF image".into());
    }
    match u16_at(18) {
        Some(EM_CUDA) => {}
        Some(machine) => return bad(format!("an ELF image for machine {machine}, not CUDA ({EM_CUDA})")),
        None => return bad("a truncated ELF header".into()),
    }
    let len = image.len() as u64;
    let (Some(ph_entry), Some(ph_count), Some(sh_entry), Some(sh_count), Some(names)) =
        (u16_at(0x36), u16_at(0x38), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e))
    else {
        return bad("a truncated ELF header".into());
    };
    // Extended numbering (0 or 0xffff counts, an escaped name-table index) would make a reader
    // look for the real counts elsewhere: a CUBIN never needs it, so it is refused, as are entry
    // sizes other than ELF64's, which a reader using `sizeof` would walk past.
    if sh_count == 0 || sh_count == 0xffff || ph_count == 0xffff || names >= sh_count {
        return bad(format!("an ELF header with {sh_count} sections, {ph_count} segments and name table {names}"));
    }
    if sh_entry != 64 || (ph_count > 0 && ph_entry != 56) {
        return bad(format!("ELF entry sizes {ph_entry} and {sh_entry}, not ELF64's 56 and 64"));
    }
    // (offset of the table, entry size, entries, offset and size fields within an entry)
    let tables = [
        ("program header", u64_at(0x20), ph_entry, ph_count, 0x08, 0x20),
        ("section header", u64_at(0x28), sh_entry, sh_count, 0x18, 0x20),
    ];
    for (what, offset, entry, count, field_offset, field_size) in tables {
        let Some(offset) = offset else {
            return bad("a truncated ELF header".into());
        };
        if count == 0 {
            continue;
        }
        let (entry, count) = (u64::from(entry), u64::from(count));
        if offset.checked_add(entry * count).is_none_or(|end| end > len) {
            return bad(format!("its {what} table lies outside the {len} bytes given"));
        }
        for i in 0..count {
            let at = (offset + i * entry) as usize;
            let kind = u32_at(at + 4);
            // Sections of type SHT_NOBITS (8) occupy no bytes of the image.
            if what == "section header" && kind == Some(8) {
                continue;
            }
            let start = u64_at(at + field_offset as usize).unwrap_or(u64::MAX);
            let size = u64_at(at + field_size as usize).unwrap_or(u64::MAX);
            if start.checked_add(size).is_none_or(|end| end > len) {
                return bad(format!("its {what} {i} points outside the {len} bytes given"));
            }
            // A string table (SHT_STRTAB, 3) must end in a NUL, or a reader's strlen runs off it.
            if what == "section header" && kind == Some(3) && (size == 0 || image[(start + size - 1) as usize] != 0) {
                return bad(format!("its string table (section {i}) does not end in a NUL byte"));
            }
        }
    }
    Ok(())
}

/// Whether the NVRTC library can be loaded (without loading it for good, and without panicking).
pub fn nvrtc_available() -> bool {
    nvrtc::library_present()
}

/// Compiles the kernels to a CUBIN for a real architecture such as `"sm_90"` (what
/// [`DeviceGuard`](super::DeviceGuard) loads: no PTX JIT); cached per architecture for the life
/// of the process. Errors as [`compile_ptx`].
pub fn compile_cubin(arch: &str) -> Result<Arc<[u8]>, DeviceError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<[u8]>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(cubin) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(cubin.clone());
    }
    if !nvrtc_available() {
        return Err(DeviceError::NvrtcNotFound);
    }
    let options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()];
    let source = nvrtc_source();
    let compiled = std::panic::catch_unwind(|| nvrtc::compile_cubin(&source, &options))
        .map_err(|p| DeviceError::Loader(panic_message(p)))?;
    let cubin: Arc<[u8]> = compiled.map_err(|log| DeviceError::Compile { arch: arch.to_string(), log })?.into();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(arch.to_string(), cubin.clone());
    Ok(cubin)
}

/// Compiles the kernels to PTX for a virtual architecture such as `"compute_90"`; cached per
/// architecture for the life of the process.
///
/// Returns [`DeviceError::NvrtcNotFound`] when NVRTC cannot be loaded and
/// [`DeviceError::Compile`] with NVRTC's log when the sources do not compile.
pub fn compile_ptx(arch: &str) -> Result<Arc<str>, DeviceError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<str>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(ptx.clone());
    }
    if !nvrtc_available() {
        return Err(DeviceError::NvrtcNotFound);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()],
        name: Some("kvguard.cu".into()),
        ..Default::default()
    };
    let source = nvrtc_source();
    // Loading NVRTC's symbols panics in cudarc if the library lacks one (a toolkit older than
    // this crate's cudarc features): the probe above rules out a missing library, and this turns
    // the remaining case into an error instead of a panic.
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(&source, opts))
        .map_err(|p| DeviceError::Loader(panic_message(p)))?;
    let ptx: Arc<str> = compiled
        .map_err(|e| {
            let log = match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => other.to_string(),
            };
            DeviceError::Compile { arch: arch.to_string(), log }
        })?
        .to_src()
        .into();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

/// The real architecture a CUBIN was built for (`"sm_90"`), read from its ELF flags where their
/// layout is known (CUDA ELF ABI version 7, as NVRTC 12.9 writes for sm_80 and sm_90); `None`
/// otherwise. For messages only: whether a device runs an image is the driver's call.
pub fn cubin_arch(image: &[u8]) -> Option<String> {
    if image.len() < 64 || &image[..4] != b"\x7fELF" || image[8] != 7 {
        return None;
    }
    let flags = le::u32_at(image, 0x30)?;
    Some(format!("sm_{}", flags & 0xff))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A minimal CUBIN-shaped ELF image: header, one program header, and a section table of a
    /// null section, a `PROGBITS` section of 16 bytes and a `NOBITS` section (no bytes).
    pub(crate) fn tiny_cubin() -> Vec<u8> {
        let mut image = vec![0u8; 64 + 56 + 16 + 3 * 64];
        image[..4].copy_from_slice(b"\x7fELF");
        (image[4], image[5], image[6], image[8]) = (2, 1, 1, 7);
        image[0x30..0x34].copy_from_slice(&0x005a_055au32.to_le_bytes()); // sm_90, as NVRTC 12.9 writes
        image[18..20].copy_from_slice(&EM_CUDA.to_le_bytes());
        let (ph, data, sh) = (64u64, 64 + 56u64, 64 + 56 + 16u64);
        image[0x20..0x28].copy_from_slice(&ph.to_le_bytes());
        image[0x28..0x30].copy_from_slice(&sh.to_le_bytes());
        image[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        image[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        image[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        image[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        let ph = ph as usize;
        image[ph + 0x08..ph + 0x10].copy_from_slice(&data.to_le_bytes());
        image[ph + 0x20..ph + 0x28].copy_from_slice(&16u64.to_le_bytes());
        for (i, (kind, offset, size)) in [(1u32, data, 16u64), (8, 1 << 40, 1 << 20)].into_iter().enumerate() {
            let at = sh as usize + (i + 1) * 64;
            image[at + 4..at + 8].copy_from_slice(&kind.to_le_bytes());
            image[at + 0x18..at + 0x20].copy_from_slice(&offset.to_le_bytes());
            image[at + 0x20..at + 0x28].copy_from_slice(&size.to_le_bytes());
        }
        image
    }

    fn refused(image: &[u8]) -> String {
        match check_cubin(image) {
            Err(DeviceError::Cubin(why)) => why,
            other => panic!("expected DeviceError::Cubin, got {other:?}"),
        }
    }

    #[test]
    fn a_well_formed_cuda_elf_image_passes_the_check() {
        check_cubin(&tiny_cubin()).unwrap();
        assert_eq!(cubin_arch(&tiny_cubin()).as_deref(), Some("sm_90"));
        assert_eq!(cubin_arch(b"\x7fELF"), None);
    }

    #[test]
    fn images_the_driver_must_not_read_are_refused_before_it_does() {
        assert!(refused(b"").contains("not an ELF image"));
        assert!(
            refused(b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.7\n.target sm_90\n").contains("not an ELF")
        );
        let image = tiny_cubin();
        let mut host = image.clone();
        host[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        assert!(refused(&host).contains("not CUDA"));
        let mut elf32 = image.clone();
        elf32[4] = 1;
        assert!(refused(&elf32).contains("64-bit"));
        assert!(refused(&image[..image.len() - 1]).contains("section header table"));
        let mut past_end = image.clone();
        let at = 64 + 56 + 16 + 64 + 0x20; // section 1's size
        let beyond = image.len() as u64 - (64 + 56) + 1; // from section 1's start to one past the end
        past_end[at..at + 8].copy_from_slice(&beyond.to_le_bytes());
        assert!(refused(&past_end).contains("section header 1"));
        let mut wrapping = image.clone();
        wrapping[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(refused(&wrapping).contains("section header 1"));
        let mut program = image;
        program[64 + 0x20..64 + 0x28].copy_from_slice(&1000u64.to_le_bytes());
        assert!(refused(&program).contains("program header 0"));
    }

    #[test]
    fn headers_that_send_a_reader_outside_the_image_are_refused() {
        let image = tiny_cubin();
        // Extended section numbering: no sections here, the real count far away.
        let mut extended = image.clone();
        extended[0x3c..0x3e].copy_from_slice(&0u16.to_le_bytes());
        extended[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(refused(&extended).contains("0 sections"));
        let mut escaped = image.clone();
        escaped[0x3e..0x40].copy_from_slice(&3u16.to_le_bytes()); // name table index == count
        assert!(refused(&escaped).contains("name table 3"));
        let mut short_entries = image.clone();
        short_entries[0x3a..0x3c].copy_from_slice(&40u16.to_le_bytes());
        assert!(refused(&short_entries).contains("entry sizes"));
        // Section 1 as a string table whose last byte is not a NUL.
        let mut unterminated = image;
        let at = 64 + 56 + 16 + 64;
        unterminated[at + 4..at + 8].copy_from_slice(&3u32.to_le_bytes());
        unterminated[64 + 56 + 15] = b'x';
        assert!(refused(&unterminated).contains("NUL"));
        unterminated[64 + 56 + 15] = 0;
        check_cubin(&unterminated).unwrap();
    }

    #[test]
    fn every_prefix_of_an_image_is_refused_or_passes_without_panicking() {
        let image = tiny_cubin();
        for end in 0..image.len() {
            assert!(check_cubin(&image[..end]).is_err(), "a {end}-byte prefix passed");
        }
    }

    #[test]
    fn the_nvrtc_source_ends_with_the_fingerprint_kernel_of_the_sources() {
        let name = fingerprint_kernel();
        assert!(name.starts_with("kvg_source_") && name.len() == "kvg_source_".len() + 16, "{name}");
        assert_eq!(name, fingerprint_kernel(), "the fingerprint is a function of the embedded sources");
        let source = nvrtc_source();
        assert_eq!(source.matches(&format!("extern \"C\" __global__ void {name}() {{}}")).count(), 1);
        assert!(!KERNELS.contains(&name.as_str()));
    }
}
