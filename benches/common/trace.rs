//! The replay benchmarks' trace: a clean, realistic v1 trace of a continuous-batching engine
//! (shared by `benches/replay.rs` and `benches/instructions.rs`).

use std::fmt::Write;

const PAGE_SIZE: u64 = 16;

struct Seq {
    req: u64,
    pages: Vec<u64>,
    len: u64,
    end: u64,
}

/// About `events` events of a continuous-batching engine, as v1 text.
pub fn trace(events: usize) -> (String, usize) {
    let mut out = String::with_capacity(events * 80);
    out.push_str("{\"ev\":\"pool\",\"pages\":65536,\"page_size\":16,\"max_context\":4096,\"reserved\":[0]}\n");
    let mut n = 1;
    let mut free: Vec<u64> = (1..65536).rev().collect();
    let mut next_req = 0u64;
    let mut live: Vec<Seq> = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    let list = |pages: &[u64]| pages.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    while n < events {
        while live.len() < 32 {
            next_req += 1;
            let prompt = 16 + rand(300);
            let max_new = 16 + rand(200);
            let tenant = ["acme", "globex", "initech"][rand(3) as usize];
            let need = prompt.div_ceil(PAGE_SIZE) as usize;
            let pages: Vec<u64> = free.drain(free.len() - need..).collect();
            let p = list(&pages);
            let _ = writeln!(
                out,
                "{{\"ev\":\"admit\",\"req\":{next_req},\"tenant\":\"{tenant}\",\"prompt\":{prompt},\"max_new\":{max_new}}}"
            );
            let _ = writeln!(out, "{{\"ev\":\"alloc\",\"req\":{next_req},\"pages\":[{p}]}}");
            for (b, page) in pages.iter().enumerate() {
                let end = (prompt - b as u64 * PAGE_SIZE).min(PAGE_SIZE);
                let _ = writeln!(out, "{{\"ev\":\"write\",\"req\":{next_req},\"page\":{page},\"slots\":[0,{end}]}}");
            }
            let _ = writeln!(out, "{{\"ev\":\"read\",\"req\":{next_req},\"pages\":[{p}],\"tokens\":{prompt}}}");
            n += 3 + pages.len();
            live.push(Seq { req: next_req, pages, len: prompt, end: prompt + max_new });
        }
        for i in (0..live.len()).rev() {
            let s = &mut live[i];
            if s.len == s.end {
                let _ = writeln!(out, "{{\"ev\":\"free\",\"req\":{}}}", s.req);
                n += 1;
                free.extend(&s.pages);
                live.swap_remove(i);
                continue;
            }
            if s.len.is_multiple_of(PAGE_SIZE) {
                let page = free.pop().expect("the pool outlasts 32 requests");
                let _ = writeln!(out, "{{\"ev\":\"alloc\",\"req\":{},\"pages\":[{page}]}}", s.req);
                s.pages.push(page);
                n += 1;
            }
            let (page, slot) = (s.pages[(s.len / PAGE_SIZE) as usize], s.len % PAGE_SIZE);
            let _ =
                writeln!(out, "{{\"ev\":\"write\",\"req\":{},\"page\":{page},\"slots\":[{slot},{}]}}", s.req, slot + 1);
            s.len += 1;
            let _ = writeln!(
                out,
                "{{\"ev\":\"read\",\"req\":{},\"pages\":[{}],\"tokens\":{}}}",
                s.req,
                list(&s.pages),
                s.len
            );
            n += 2;
        }
    }
    (out, n)
}
