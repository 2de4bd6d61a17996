//! The replay's traffic: tenants sending interleaved requests, a few of them longer than the
//! prefill pool, with prompts whose tokens say whose they are.

use crate::SimConfig;
use crate::rng::{SplitMix64, mix64};
use kvguard::{RequestId, TenantId};

/// One request as the router sent it to both nodes (each keeps its own copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// Its id (from 1; 0 means "nobody" in the simulated KV).
    pub id: RequestId,
    /// Its tenant (from 1).
    pub tenant: TenantId,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// New tokens it may generate.
    pub max_new_tokens: u32,
    /// The seed its prompt is drawn from.
    pub prompt_seed: u64,
}

impl RequestSpec {
    /// Token `i` of the prompt: the tenant in the top byte, the rest drawn from the request's seed,
    /// so a token read by the wrong request is recognisable as another tenant's.
    #[inline]
    pub fn token(&self, i: u32) -> u32 {
        let low = (mix64(self.prompt_seed ^ u64::from(i)) & 0x00FF_FFFF) as u32;
        ((self.tenant.0 as u32 & 0xFF) << 24) | low
    }

    /// The whole prompt.
    pub fn prompt(&self) -> Vec<u32> {
        (0..self.prompt_tokens).map(|i| self.token(i)).collect()
    }
}

/// The requests of one replay, in arrival order.
pub fn generate(config: &SimConfig) -> Vec<RequestSpec> {
    let mut rng = SplitMix64::new(config.seed);
    let prefill_capacity = u64::from(config.prefill_pages) * u64::from(config.page_size);
    let longest = config.max_context.saturating_sub(u64::from(config.max_new_tokens));
    (0..config.requests)
        .map(|i| {
            let tenant = TenantId(rng.range(1, u64::from(config.tenants.max(1))));
            let prompt = if rng.chance(config.long_per_mille) {
                rng.range(prefill_capacity + 1, longest)
            } else {
                rng.range(1, u64::from(config.max_short_prompt))
            };
            RequestSpec {
                id: RequestId(u64::from(i) + 1),
                tenant,
                // Prompts are bounded by the max context, which the config keeps within `u32`.
                prompt_tokens: u32::try_from(prompt).unwrap_or(u32::MAX),
                max_new_tokens: config.max_new_tokens,
                prompt_seed: rng.next_u64(),
            }
        })
        .collect()
}
