//! `Manifest::decode` on arbitrary bytes: never panics, never allocates past the input's size, and
//! whatever it accepts re-encodes to exactly the bytes it was given (one encoding per manifest).
#![no_main]
use kvguard::transfer::{ExpectedTransfer, Manifest, PromptDigest, verify};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(manifest) = Manifest::decode(data) else {
        return;
    };
    assert_eq!(manifest.encode(), data, "decode accepted a non-canonical encoding");
    // The receiver's checks on a decoded manifest never panic either, whatever the pages.
    let dest: Vec<_> = manifest.pages().iter().map(|p| p.dest).collect();
    let expected = ExpectedTransfer {
        request: manifest.request(),
        tenant: manifest.tenant(),
        sender: None,
        prompt_tokens: manifest.prompt_tokens(),
        prompt_digest: PromptDigest(manifest.prompt_digest().0),
        pages: &dest,
        page_size: manifest.page_size(),
        slot_bytes: manifest.slot_bytes(),
    };
    let pages: Vec<&[u8]> = manifest.pages().iter().map(|_| &data[..data.len().min(16)]).collect();
    let _ = verify(&expected, &manifest, &pages);
});
