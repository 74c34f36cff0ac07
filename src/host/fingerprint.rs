//! Fingerprints of what must be told apart but never shown: a bearer token's digest in a
//! reload's message, a client's URI in a refusal's record.

use sha2::Digest;

/// 64 bits of SHA-256 over a secret of this process and `bytes`: two alike within one run
/// hold the same bytes, but a fingerprint cannot be used to test guesses of what it was
/// made from (an email address, a customer id, a token), as a plain digest of a short or
/// guessable value could. Another process shows other fingerprints for the same bytes.
pub fn of(bytes: &[u8]) -> String {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    let key = KEY.get_or_init(|| {
        let mut key = [0u8; 32];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut key);
        key
    });
    let keyed = sha2::Sha256::new()
        .chain_update(key)
        .chain_update(bytes)
        .finalize();
    hex::encode(&keyed[..8])
}

#[cfg(test)]
mod tests {
    #[test]
    fn alike_bytes_alike_fingerprints_and_no_plain_digest() {
        use sha2::Digest;
        let a = super::of(b"jane.doe@example.com");
        assert_eq!(a, super::of(b"jane.doe@example.com"));
        assert_ne!(a, super::of(b"john.doe@example.com"));
        let plain = hex::encode(&sha2::Sha256::digest(b"jane.doe@example.com")[..8]);
        assert_ne!(a, plain);
    }
}
