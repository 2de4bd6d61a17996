//! The arguments of the device launches: the engine's steps in vLLM's and FlashInfer's layouts,
//! the reference KV store and attention, page regions for CRC32 and scrubbing, and the checks
//! that what the engine lent holds every element a launch will touch.

use super::error::DeviceError;
use super::lent::Borrowed;

/// A decode step in vLLM's layout: `block_table[num_seqs][max_blocks]` (int32) and
/// `seq_lens[num_seqs]` (int32 tokens read), both the engine's device memory.
///
/// [`BlockTableStep::new`] gives the recipe's defaults: no generations, canaries off. Canaries
/// are only meaningful when every KV write goes through kvguard's stamping store
/// ([`DeviceGuard::store_kv`](super::DeviceGuard::store_kv), or `kvg_stamp_canary` in the
/// engine's own store) or is seeded by
/// [`DeviceGuard::write_canaries`](super::DeviceGuard::write_canaries): an engine that keeps its
/// own unstamped KV-store kernel must leave them off, or every sequence is flagged.
#[derive(Clone, Copy, Debug)]
pub struct BlockTableStep {
    /// The block table, row-major, `max_blocks` entries per row.
    pub block_table: Borrowed<i32>,
    /// Tokens each sequence reads.
    pub seq_lens: Borrowed<i32>,
    /// Sequences in the step: at most the readers named for this step by
    /// [`DeviceGuard::set_readers`](super::DeviceGuard::set_readers).
    pub num_seqs: u32,
    /// Entries per block-table row (the row stride, e.g. `max_model_len / page_size`; the
    /// launch is sized by sequence, so a wide table costs nothing).
    pub max_blocks: u32,
    /// Optional: the generation the engine recorded for each entry (the block table's shape);
    /// entries of another incarnation are [`StalePage`](crate::ViolationKind::StalePage).
    pub generations: Option<Borrowed<u32>>,
    /// Also check the canary of every read slot written before this step (KV stamped by the
    /// current incarnation). Off by default: see the type's documentation.
    pub check_canaries: bool,
    /// With canaries: each sequence's tokens of this step (its query length: 1 for a decode, the
    /// chunk for a prefill), `[num_seqs]` int32. A verify placed before the forward pass runs
    /// before this step's KV is stored, so slots `seq_len - query_len .. seq_len` are not yet
    /// stamped and their canaries are not checked. `None`: every slot read was written before
    /// this verify (it runs after the store). A length below 0 or above `seq_len` is a malformed
    /// step ([`BadLayout`](super::DeviceKind::BadLayout)).
    pub query_lens: Option<Borrowed<i32>>,
}

impl BlockTableStep {
    /// A step with the recipe's defaults: no generations, canaries off.
    pub fn new(block_table: Borrowed<i32>, seq_lens: Borrowed<i32>, num_seqs: u32, max_blocks: u32) -> Self {
        BlockTableStep {
            block_table,
            seq_lens,
            num_seqs,
            max_blocks,
            generations: None,
            check_canaries: false,
            query_lens: None,
        }
    }
}

/// A step in SGLang's layout, read in place: `req_to_token[num_rows][row_stride]` (int32, one
/// token slot per entry, `page * page_size + offset`: SGLang's `ReqToTokenPool.req_to_token`),
/// sequence `s` reading row `rows[s]` for `seq_lens[s]` tokens (int64 both: the forward batch's
/// `req_pool_indices` and `seq_lens`), all the engine's device memory. Page `j` of a sequence is
/// the page of its row's entry `j * page_size`, the entry the host check of token-slot rows reads
/// (the Python binding's `verify_step_rows(..., token_slots=True)`), and every other entry read
/// must be that page's slot at its offset (one that is not is checked as the page it names, up
/// to its slot, as the host check does): no gather of the rows into a block table first. A row outside `num_rows` or a negative length is
/// a malformed step ([`BadLayout`](super::DeviceKind::BadLayout)); more tokens than the row has
/// entries (a row may end inside its last page),
/// [`BlockTableTooShort`](crate::ViolationKind::BlockTableTooShort). No generations,
/// no canaries: SGLang's own KV store stamps none.
#[derive(Clone, Copy, Debug)]
pub struct TokenRowsStep {
    /// The engine's whole `req_to_token`, row-major, `row_stride` entries per row.
    pub req_to_token: Borrowed<i32>,
    /// Rows of `req_to_token`.
    pub num_rows: u32,
    /// Entries per row (the engine's max context length).
    pub row_stride: u32,
    /// Each sequence's row.
    pub rows: Borrowed<i64>,
    /// Tokens each sequence reads.
    pub seq_lens: Borrowed<i64>,
    /// Sequences in the step: at most the readers named for this step.
    pub num_seqs: u32,
    /// An upper bound on pages per sequence (caps the grid; any value is correct).
    pub max_pages_per_seq: u32,
}

/// A step's KV writes, checked in place before the forward pass stores them: token `t` writes slot
/// `slot_mapping[t]` (`page * page_size + offset`, int64; negative: padding, nothing written),
/// sequence `s` writing tokens `query_start_loc[s] .. query_start_loc[s + 1]` (int32,
/// `[num_seqs + 1]`), all the engine's device memory (vLLM's Model Runner V2 computes both on the
/// device). Each written slot must lie in a page the sequence's writer (named by
/// [`DeviceGuard::set_readers`](super::DeviceGuard::set_readers)) owns exclusively, as for the
/// reference store; a sequence whose token range is malformed is flagged
/// [`BadLayout`](super::DeviceKind::BadLayout), and a slot written by a token of no sequence is
/// reported as one.
#[derive(Clone, Copy, Debug)]
pub struct SlotMappingStep {
    /// Each token's slot, `[num_tokens]`.
    pub slot_mapping: Borrowed<i64>,
    /// Tokens checked (the step's tokens, padding included).
    pub num_tokens: u32,
    /// Where each sequence's tokens start, `[num_seqs + 1]`.
    pub query_start_loc: Borrowed<i32>,
    /// Sequences in the step: at most the readers named for this step.
    pub num_seqs: u32,
}

/// The fence of a step's refused sequences, launched after the step's checks on the same stream
/// ([`DeviceGuard::fence_refused`](super::DeviceGuard::fence_refused)): every sequence whose
/// status word a check set has its row of `block_table` set to page 0 (the pool's reserved null
/// page) and its tokens' slots in `slot_mapping` set to -1 (padding), in place, so attention
/// neither reads nor writes anyone's KV for it; a slot of a token in no sequence's range becomes
/// -1 too. Either buffer may be absent (one launch per KV cache group, each with its own table
/// and slot mapping row).
#[derive(Clone, Copy, Debug)]
pub struct FenceStep {
    /// Where each sequence's tokens start, `[num_seqs + 1]`.
    pub query_start_loc: Borrowed<i32>,
    /// Sequences in the step (those the checks' status words cover).
    pub num_seqs: u32,
    /// The block table attention will read, `[num_seqs][max_blocks]`, row-major.
    pub block_table: Option<Borrowed<i32>>,
    /// Entries per block-table row.
    pub max_blocks: u32,
    /// The slots the KV store will write, `[num_tokens]`.
    pub slot_mapping: Option<Borrowed<i64>>,
    /// Tokens in `slot_mapping`.
    pub num_tokens: u32,
}

/// A decode step in FlashInfer's layout: `kv_indptr[num_seqs + 1]`, `kv_indices[..]` and
/// `kv_last_page_len[num_seqs]` (int32, the engine's device memory). Canaries as for
/// [`BlockTableStep`]: off by default ([`PagedKvStep::new`]).
#[derive(Clone, Copy, Debug)]
pub struct PagedKvStep {
    /// Where each sequence's pages start in `kv_indices`.
    pub kv_indptr: Borrowed<i32>,
    /// The pages, all sequences concatenated.
    pub kv_indices: Borrowed<i32>,
    /// Tokens in each sequence's last page (1..=page_size).
    pub kv_last_page_len: Borrowed<i32>,
    /// Sequences in the step: at most the readers named for this step.
    pub num_seqs: u32,
    /// An upper bound on pages per sequence (caps the grid; any value is correct).
    pub max_pages_per_seq: u32,
    /// Optional: generations parallel to `kv_indices`.
    pub generations: Option<Borrowed<u32>>,
    /// Also check the canary of every read slot written before this step (off by default).
    pub check_canaries: bool,
    /// With canaries: each sequence's tokens of this step, as
    /// [`BlockTableStep::query_lens`].
    pub query_lens: Option<Borrowed<i32>>,
}

impl PagedKvStep {
    /// A step with the recipe's defaults: no generations, canaries off.
    pub fn new(
        kv_indptr: Borrowed<i32>,
        kv_indices: Borrowed<i32>,
        kv_last_page_len: Borrowed<i32>,
        num_seqs: u32,
        max_pages_per_seq: u32,
    ) -> Self {
        PagedKvStep {
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            num_seqs,
            max_pages_per_seq,
            generations: None,
            check_canaries: false,
            query_lens: None,
        }
    }
}

/// One launch of the reference KV store: `num_tokens` tokens of `kv_width` elements each, token
/// `t` going to slot `slot_mapping[t]` of the paged caches; `query_start_loc[s]..[s + 1]` are the
/// tokens of sequence `s` (whose reader is set by
/// [`DeviceGuard::set_readers`](super::DeviceGuard::set_readers)). All buffers are the engine's
/// device memory.
#[derive(Clone, Copy, Debug)]
pub struct KvStore<T> {
    /// The new keys, `[num_tokens][kv_width]`.
    pub key: Borrowed<T>,
    /// The new values, `[num_tokens][kv_width]`.
    pub value: Borrowed<T>,
    /// The paged key cache, `[num_pages * page_size][kv_width]`.
    pub key_cache: Borrowed<T>,
    /// The paged value cache, same shape.
    pub value_cache: Borrowed<T>,
    /// Each token's cache slot (`page * page_size + offset`), `[num_tokens]`.
    pub slot_mapping: Borrowed<i64>,
    /// Tokens stored.
    pub num_tokens: u32,
    /// Elements per token and cache slot.
    pub kv_width: u32,
    /// Where each sequence's tokens start, `[num_seqs + 1]`.
    pub query_start_loc: Borrowed<i32>,
    /// Sequences in the launch (at most [`DeviceOptions::max_seqs`](super::DeviceOptions::max_seqs)).
    pub num_seqs: u32,
}

/// One launch of the paged decode attention (vLLM layout, GQA): the shape and the engine's device
/// buffers. The K/V caches hold `T`: `f32`, or [`Bf16`] (what engines store); queries and the
/// output are `f32`.
///
/// The kernel is a split-KV ("flash-decoding") paged attention: each block takes one sequence,
/// up to four query heads of one KV head (so K/V are read once per four query heads) and one share of
/// the sequence's pages; four warps stream whole pages with 16-byte loads. Splitting needs
/// `workspace` (the partial results and a counter per sequence and head block; zeroed once by
/// the caller, left zeroed by every launch); without one, each sequence is one block's work.
#[derive(Clone, Copy, Debug)]
pub struct DecodeAttention<T: AttentionElement = f32> {
    /// Sequences, heads, head size, block-table width and softmax scale.
    pub shape: AttentionShape,
    /// The queries, `[num_seqs][num_heads][head_dim]`.
    pub q: Borrowed<f32>,
    /// The paged key cache, `[num_pages * page_size][num_kv_heads][head_dim]`.
    pub key_cache: Borrowed<T>,
    /// The paged value cache, same shape.
    pub value_cache: Borrowed<T>,
    /// The block table, `[num_seqs][max_blocks]`.
    pub block_table: Borrowed<i32>,
    /// Tokens each sequence reads.
    pub seq_lens: Borrowed<i32>,
    /// The output, `[num_seqs][num_heads][head_dim]`.
    pub out: Borrowed<f32>,
    /// Scratch for splitting each sequence's pages over several blocks: zeroed device memory of
    /// at least [`AttentionShape::workspace_len`]`(splits)` words; the launch splits as far as
    /// it holds (at most [`AttentionShape::MAX_SPLITS`]). `None`: no split.
    pub workspace: Option<Borrowed<f32>>,
}

/// A bfloat16 value, as its 16 bits (the KV caches of [`DecodeAttention<Bf16>`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// The bfloat16 nearest to `x` (round to nearest even; NaN stays NaN).
    pub fn from_f32(x: f32) -> Bf16 {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(round) >> 16) as u16)
    }
    /// Its value as an `f32` (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// Element types of the attention's K/V caches: `f32` and [`Bf16`].
pub trait AttentionElement: sealed::SealedAttention + Copy {
    /// Whether this is [`Bf16`] (the kernels' `_bf16` variants).
    const BF16: bool;
}
impl AttentionElement for f32 {
    const BF16: bool = false;
}
impl AttentionElement for Bf16 {
    const BF16: bool = true;
}

/// What the fused check of
/// [`DeviceGuard::decode_attention_checked`](super::DeviceGuard::decode_attention_checked) does
/// besides checking every page's tag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionCheck {
    /// Also check every read slot's canary.
    pub check_canaries: bool,
    /// A flagged sequence's output is zeros (otherwise: flagged only, the output computed).
    pub fail_closed: bool,
}

/// The shape of a decode-attention launch (vLLM layout, GQA).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Sequences in the step.
    pub num_seqs: u32,
    /// Entries per block-table row.
    pub max_blocks: u32,
    /// Query heads.
    pub num_heads: u32,
    /// KV heads (divides `num_heads`).
    pub num_kv_heads: u32,
    /// Head dimension: a multiple of 32, at most 256.
    pub head_dim: u32,
    /// Softmax scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl AttentionShape {
    /// The most splits of a sequence's KV length one launch makes.
    pub const MAX_SPLITS: u32 = 64;
    /// Query heads one block takes (of one KV head): `kvg_decode_attention`'s `KVG_ATTN_MAX_GROUP`.
    pub const HEADS_PER_BLOCK: u32 = 4;

    /// Head blocks per sequence: each KV head's query heads, four at a time.
    pub fn head_blocks(&self) -> u32 {
        let group = (self.num_heads / self.num_kv_heads.max(1)).max(1);
        self.num_kv_heads.max(1) * group.div_ceil(Self::HEADS_PER_BLOCK)
    }

    /// Words (`f32`) of workspace a launch of `splits` splits needs: a counter per sequence and
    /// head block (padded to 16 bytes), then `head_dim + 2` words per sequence, head and split.
    pub fn workspace_len(&self, splits: u32) -> u64 {
        let counters = (u64::from(self.num_seqs) * u64::from(self.head_blocks())).next_multiple_of(4);
        let partials = u64::from(self.num_seqs) * u64::from(self.num_heads) * u64::from(splits);
        counters + partials * (u64::from(self.head_dim) + 2)
    }
}

impl<T: AttentionElement> DecodeAttention<T> {
    /// Whether every buffer holds what the shape makes the kernels index, in a pool of
    /// `num_pages` pages of `page_size` slots.
    pub(super) fn check(&self, num_pages: u32, page_size: u32) -> Result<(), DeviceError> {
        let s = &self.shape;
        if s.head_dim == 0 || !s.head_dim.is_multiple_of(32) || s.head_dim > 256 {
            return Err(DeviceError::Argument("attention: head_dim must be a multiple of 32, at most 256".into()));
        }
        if s.num_kv_heads == 0 || !s.num_heads.is_multiple_of(s.num_kv_heads) {
            return Err(DeviceError::Argument("attention: num_kv_heads must divide num_heads".into()));
        }
        let io = u64::from(s.num_seqs) * u64::from(s.num_heads) * u64::from(s.head_dim);
        let cache = u64::from(num_pages) * u64::from(page_size) * u64::from(s.num_kv_heads) * u64::from(s.head_dim);
        if !self.key_cache.ptr().is_multiple_of(16) || !self.value_cache.ptr().is_multiple_of(16) {
            return Err(DeviceError::Argument("attention: the K/V caches must be 16-byte aligned".into()));
        }
        need("q", &self.q, io)?;
        need("out", &self.out, io)?;
        need("key_cache", &self.key_cache, cache)?;
        need("value_cache", &self.value_cache, cache)?;
        need("block_table", &self.block_table, u64::from(s.num_seqs) * u64::from(s.max_blocks))?;
        need("seq_lens", &self.seq_lens, u64::from(s.num_seqs))
    }
}

/// A pool region of engine memory: page `p` is `page_bytes` bytes at `base + p * page_stride`.
#[derive(Clone, Copy, Debug)]
pub struct PageRegion {
    /// The region's memory.
    pub base: Borrowed<u8>,
    /// Bytes from one page to the next.
    pub page_stride: u64,
    /// Bytes per page (at most `page_stride`).
    pub page_bytes: u64,
    /// Pages in the region.
    pub num_pages: u32,
}

impl PageRegion {
    /// Whether every page of the region lies inside the memory lent.
    pub(super) fn check(&self) -> Result<(), DeviceError> {
        if self.page_bytes > self.page_stride && self.num_pages > 1 {
            return Err(DeviceError::Argument("page region: page_bytes exceeds page_stride".into()));
        }
        let end = match self.num_pages {
            0 => 0,
            n => u64::from(n - 1).saturating_mul(self.page_stride).saturating_add(self.page_bytes),
        };
        need("page region", &self.base, end)
    }
}

/// Element types the reference KV store moves (it copies bits: f16 and bf16 are `u16`).
pub trait KvElement: sealed::Sealed {
    /// Bytes per element.
    const BYTES: usize;
}
impl KvElement for u16 {
    const BYTES: usize = 2;
}
impl KvElement for u32 {
    const BYTES: usize = 4;
}
impl KvElement for f32 {
    const BYTES: usize = 4;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
    impl Sealed for f32 {}
    pub trait SealedAttention {}
    impl SealedAttention for f32 {}
    impl SealedAttention for super::Bf16 {}
}

/// Whether `b` lends at least `elements` elements.
pub(super) fn need<T>(what: &str, b: &Borrowed<T>, elements: u64) -> Result<(), DeviceError> {
    if (b.len() as u64) < elements {
        return Err(DeviceError::Argument(format!("{what}: {elements} elements needed, {} lent", b.len())));
    }
    Ok(())
}

/// Whether `b`, if given, lends at least `elements` elements.
pub(super) fn need_opt<T>(what: &str, b: &Option<Borrowed<T>>, elements: u64) -> Result<(), DeviceError> {
    b.as_ref().map_or(Ok(()), |b| need(what, b, elements))
}

/// Whether a launch over `num_seqs` sequences reads only readers named for this step:
/// `readers_set` is how many the last [`DeviceGuard::set_readers`](super::DeviceGuard::set_readers)
/// wrote. Sequences beyond them would be judged as whoever sat there in an earlier step (a
/// false negative of exactly the incident's kind), so the launch is refused on the host.
pub(super) fn readers_cover(what: &str, num_seqs: u32, readers_set: u32) -> Result<(), DeviceError> {
    if num_seqs > readers_set {
        return Err(DeviceError::Argument(format!(
            "{what}: {num_seqs} sequences, but set_readers named {readers_set} for this step"
        )));
    }
    Ok(())
}

/// Whether `count` fits a buffer of `capacity`.
pub(super) fn fits(what: &str, count: u64, capacity: u64) -> Result<(), DeviceError> {
    if count > capacity {
        return Err(DeviceError::Argument(format!("{what}: {count} exceeds the capacity {capacity}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_widens_exactly() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn the_workspace_holds_a_counter_per_head_block_and_a_partial_per_head_and_split() {
        let shape =
            AttentionShape { num_seqs: 3, max_blocks: 8, num_heads: 32, num_kv_heads: 2, head_dim: 64, scale: 1.0 };
        assert_eq!(shape.head_blocks(), 8, "16 query heads per KV head: four blocks of four");
        assert_eq!(shape.workspace_len(1), 24 + 3 * 32 * 66);
        assert_eq!(shape.workspace_len(4), 24 + 3 * 32 * 4 * 66);
        let mha = AttentionShape { num_heads: 2, ..shape };
        assert_eq!(mha.head_blocks(), 2);
        assert_eq!(mha.workspace_len(2), 8 + 3 * 2 * 2 * 66);
    }

    #[test]
    fn a_step_over_more_sequences_than_readers_set_is_refused() {
        assert!(readers_cover("verify", 4, 4).is_ok());
        assert!(readers_cover("verify", 0, 0).is_ok());
        assert!(readers_cover("verify", 3, 8).is_ok());
        match readers_cover("verify", 5, 4) {
            Err(DeviceError::Argument(why)) => {
                assert!(why.contains("5 sequences") && why.contains("named 4"), "{why}");
            }
            other => panic!("expected DeviceError::Argument, got {other:?}"),
        }
        // No set_readers yet: nothing may be judged.
        assert!(matches!(readers_cover("store", 1, 0), Err(DeviceError::Argument(_))));
    }
}
