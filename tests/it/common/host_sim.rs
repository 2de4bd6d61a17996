//! The Rust side of the CPU kernel simulator (kernels/host/kvguard_sim_main.cpp), used by the
//! `tests/cuda_host_*.rs` test crates: builds the driver once per process, exchanges
//! little-endian arrays with it through a directory per run, and sets up a pool with every kind of
//! page for the kernels to be checked against the ownership table.

use super::skip;
use kvguard::cuda::layout::{DeviceReader, DeviceTag, RingDrain, canary};
use kvguard::{Generation, OwnershipTable, PageId, Policy, PoolConfig, PrefixKey, RequestId, TenantId};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

// ------------------------------------------------------------------------------------------------
// The driver program and its file exchange
// ------------------------------------------------------------------------------------------------

pub fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// Builds kernels/host/kvguard_sim_main.cpp once per test process; `None` if no C++ compiler.
pub fn driver() -> Option<&'static Path> {
    static DRIVER: OnceLock<Option<PathBuf>> = OnceLock::new();
    let built = DRIVER.get_or_init(|| {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvguard-sim");
        std::fs::create_dir_all(&out_dir).unwrap();
        // Built under a private name, then renamed into place: concurrent runs never see half a file.
        let exe = out_dir.join("kvguard_sim");
        let building = out_dir.join(format!("kvguard_sim.{}", std::process::id()));
        let run = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"])
            .arg("-o")
            .arg(&building)
            .arg(kernels_dir().join("host/kvguard_sim_main.cpp"))
            .output();
        match run {
            Err(e) => {
                let required = std::env::var("KVGUARD_REQUIRE_HOSTCXX").is_ok_and(|v| v == "1");
                assert!(!required, "KVGUARD_REQUIRE_HOSTCXX=1 but the C++ compiler `{cxx}` cannot run: {e}");
                None
            }
            Ok(o) => {
                assert!(
                    o.status.success(),
                    "the kernels do not compile as host C++:\n{}",
                    String::from_utf8_lossy(&o.stderr)
                );
                std::fs::rename(&building, &exe).unwrap();
                Some(exe)
            }
        }
    });
    if built.is_none() {
        skip::skipped("no C++ compiler (set CXX, or install g++): host kernel tests not run");
    }
    built.as_deref()
}

/// One kernel run: inputs written to a fresh directory, outputs read back.
pub struct Case {
    dir: PathBuf,
    params: String,
}

impl Case {
    pub fn new(name: &str) -> Case {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("kvguard-sim")
            .join(format!("{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Case { dir, params: String::new() }
    }
    pub fn param(&mut self, name: &str, value: impl std::fmt::Display) -> &mut Self {
        self.params.push_str(&format!("{name} {value}\n"));
        self
    }
    pub fn bytes(&mut self, name: &str, data: &[u8]) -> &mut Self {
        std::fs::write(self.dir.join(format!("{name}.bin")), data).unwrap();
        self
    }
    pub fn u32s(&mut self, name: &str, v: &[u32]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn i32s(&mut self, name: &str, v: &[i32]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn i64s(&mut self, name: &str, v: &[i64]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn u64s(&mut self, name: &str, v: &[u64]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn f32s(&mut self, name: &str, v: &[f32]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn tags(&mut self, name: &str, v: &[DeviceTag]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|t| t.to_bytes()).collect::<Vec<_>>())
    }
    pub fn readers(&mut self, name: &str, v: &[DeviceReader]) -> &mut Self {
        self.bytes(name, &v.iter().flat_map(|r| r.to_bytes()).collect::<Vec<_>>())
    }
    /// Runs the driver over this case's directory.
    pub fn run(&mut self, exe: &Path, command: &str) {
        std::fs::write(self.dir.join("params.txt"), &self.params).unwrap();
        let o = Command::new(exe).arg(command).arg(&self.dir).output().unwrap();
        assert!(o.status.success(), "kvguard_sim {command} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    }
    pub fn out(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(format!("{name}.out"))).unwrap()
    }
    pub fn out_u32(&self, name: &str) -> Vec<u32> {
        self.out(name).chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
    }
    pub fn out_f32(&self, name: &str) -> Vec<f32> {
        self.out(name).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }
    pub fn out_tags(&self, name: &str) -> Vec<DeviceTag> {
        self.out(name).chunks_exact(DeviceTag::SIZE).map(|c| DeviceTag::from_bytes(c).unwrap()).collect()
    }
    pub fn ring(&self) -> RingDrain {
        RingDrain::parse(&self.out("ring")).expect("a well-formed ring")
    }
}

impl Drop for Case {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// splitmix64: small, deterministic, good enough for test inputs.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

// ------------------------------------------------------------------------------------------------
// A pool with every kind of page: owned, shared (prefix), freed, reused, reserved
// ------------------------------------------------------------------------------------------------

pub const PS: u32 = 4;
pub const NUM_PAGES: u32 = 48;

pub struct Pool {
    pub table: OwnershipTable,
    /// (request, tenant, its readable pages in block-table order, tokens written through them)
    pub requests: Vec<(RequestId, TenantId, Vec<PageId>, u64)>,
    /// A page that was released and handed to another request (generation 2).
    pub reused: PageId,
    /// A page that is free.
    pub freed: PageId,
    /// The shared prefix pages.
    pub prefix: Vec<PageId>,
}

pub fn pool() -> Pool {
    let config = PoolConfig::new(NUM_PAGES, PS, 64).with_reserved([PageId(0)]).with_policy(Policy::Report);
    let table = OwnershipTable::new(config).unwrap();
    let (a, b, c, d, e, f) = (RequestId(1), RequestId(2), RequestId(3), RequestId(4), RequestId(5), RequestId(6));
    for (r, t) in [(a, 10), (b, 10), (c, 20), (d, 20), (e, 30), (f, 30)] {
        table.admit(r, TenantId(t), 20, 20).unwrap();
    }
    let alloc =
        |r: RequestId, n: u32| -> Vec<PageId> { table.allocate(r, n).unwrap().iter().map(|x| x.page).collect() };
    let pa = alloc(a, 4);
    table.record_write_tokens(a, &pa, 0..14).unwrap();
    let pb = alloc(b, 3);
    table.record_write_tokens(b, &pb, 0..12).unwrap();
    let pc = alloc(c, 4);
    table.record_write_tokens(c, &pc, 0..16).unwrap();
    let pd = alloc(d, 2);
    table.record_write_tokens(d, &pd, 0..5).unwrap();
    let pe = alloc(e, 2);
    table.record_write_tokens(e, &pe, 0..8).unwrap();
    table.release(e).unwrap();
    let pf = alloc(f, 1);
    table.record_write_tokens(f, &pf, 0..4).unwrap();
    assert!(pe.contains(&pf[0]), "the free list reuses the last released page");
    assert_eq!(table.page_info(pf[0]).unwrap().generation, Generation(2));
    let freed = *pe.iter().find(|p| **p != pf[0]).unwrap();
    // A publishes its first two (full) pages; B, same tenant, reads through them.
    table.publish_prefix(a, PrefixKey(77), &pa[..2]).unwrap();
    table.attach_prefix(b, PrefixKey(77)).unwrap();
    let b_reads: Vec<PageId> = pa[..2].iter().chain(&pb).copied().collect();
    Pool {
        requests: vec![
            (a, TenantId(10), pa.clone(), 14),
            (b, TenantId(10), b_reads, 20),
            (c, TenantId(20), pc, 16),
            (d, TenantId(20), pd, 5),
            (f, TenantId(30), pf.clone(), 4),
        ],
        table,
        reused: pf[0],
        freed,
        prefix: pa[..2].to_vec(),
    }
}

impl Pool {
    pub fn device_tags(&self) -> Vec<DeviceTag> {
        (0..NUM_PAGES).map(|p| DeviceTag::from_page_info(&self.table.page_info(PageId(p)).unwrap())).collect()
    }

    /// The canaries a correct KV-store path leaves: every slot each page's current incarnation
    /// wrote is stamped by its owner; the rest are 0.
    pub fn canaries(&self) -> Vec<u32> {
        let mut c = vec![0u32; (NUM_PAGES * PS) as usize];
        for p in 0..NUM_PAGES {
            let info = self.table.page_info(PageId(p)).unwrap();
            if let Some(owner) = info.owner {
                for s in 0..info.written_prefix {
                    c[(p * PS + s) as usize] = canary(owner.0, info.generation.0, p, s);
                }
            }
        }
        c
    }

    pub fn tenant(&self, r: RequestId) -> TenantId {
        self.requests.iter().find(|x| x.0 == r).unwrap().1
    }
}
