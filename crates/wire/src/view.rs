//! What every header view shares: the struct over a buffer, `new_unchecked`, `new_checked`,
//! `into_inner`, and for fixed-size headers `check_len`. Each header module writes only its
//! fields (and its own `check_len` where the length depends on the contents).

/// `view!(doc, Name, LEN)`: a view of a fixed-size header of `LEN` bytes.
/// `view!(doc, Name)`: a view whose module implements `check_len` itself.
macro_rules! view {
    ($(#[$m:meta])* $name:ident, $len:expr) => {
        view!($(#[$m])* $name);

        impl<T: AsRef<[u8]>> $name<T> {
            /// Check that the whole header is present; getters cannot panic afterwards.
            pub fn check_len(&self) -> crate::Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err(crate::Error::Truncated)
                } else {
                    Ok(())
                }
            }
        }
    };
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wrap without checking; getters may panic until [`Self::check_len`] passes.
            pub const fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }
            /// Wrap and [check](Self::check_len); getters cannot panic afterwards (until a setter
            /// documented as invalidating the check changes a length).
            pub fn new_checked(buffer: T) -> crate::Result<Self> {
                let p = Self::new_unchecked(buffer);
                p.check_len()?;
                Ok(p)
            }
            /// Give back the buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
