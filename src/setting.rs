//! What every configuration table is made of, below the modules that own a table (the sinks, the
//! sources, the broker) and `config`, which puts the tables together: durations, the error that names
//! the key it is about, and reading a `[sinks.NAME]` or `[sources.NAME]` table so that a mistake in it
//! names its key (`sinks.NAME.KEY`) and an unknown key is refused with the list of the valid ones.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use std::path::PathBuf;
use std::time::Duration;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("parsing {path}: {error}")]
    Parse {
        path: PathBuf,
        error: Box<toml::de::Error>,
    },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
}

pub fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A duration written as `"1500ms"`, `"30s"`, `"30m"`, `"2h"`, `"7d"` or an integer of milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Millis(pub Duration);

impl Millis {
    pub fn as_ms(self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }
}

/// Parses a duration: whole numbers with units, `ms`, `s`, `m`, `h` or `d`, alone (`"1500ms"`, `"30s"`,
/// `"7d"`) or in a row, largest first (`"1m30s"`, `"2h45m"`, `"1d12h"`), as people write them.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let not_a_duration =
        || format!("{text:?} is not a duration such as \"30s\", \"5m\", \"1m30s\" or \"7d\"");
    let mut rest = text;
    let mut total: u64 = 0;
    let mut last_unit_ms = u64::MAX;
    loop {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let number: u64 = rest[..digits].parse().map_err(|_| not_a_duration())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ms: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => {
                return Err(format!(
                    "{text:?} has no unit: use ms, s, m, h or d (\"30s\", \"5m\", \"1m30s\")"
                ))
            }
            _ => return Err(not_a_duration()),
        };
        if unit_ms >= last_unit_ms {
            return Err(format!(
                "{text:?}: give the units largest first, each once (\"1h30m\")"
            ));
        }
        last_unit_ms = unit_ms;
        rest = &rest[unit_len..];
        total = number
            .checked_mul(unit_ms)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("{text:?} is too long"))?;
        if rest.is_empty() {
            return Ok(Duration::from_millis(total));
        }
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Millis, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Ms(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Ms(ms) => Ok(Millis(Duration::from_millis(ms))),
            Raw::Text(text) => parse_duration(&text)
                .map(Millis)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// The keys a table type takes: the field names its derived `Deserialize` asks for (renames included).
/// A table type is a struct deriving `Deserialize`; anything else takes no keys.
pub fn keys_of<T: DeserializeOwned>() -> &'static [&'static str] {
    /// A deserializer that only notes the fields it is asked for.
    struct Fields<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Fields<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("fields noted"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
}

/// A `[sinks.NAME]` or `[sources.NAME]` table being read, a part at a time: the keys every table of
/// its kind takes, then those of its `kind`. What is left at the end was not a key of the table.
#[derive(Debug)]
pub struct TableReader {
    key: String,
    entries: toml::Table,
    /// The keys the parts read so far take, for the error that names an unknown one.
    valid: Vec<&'static str>,
}

impl TableReader {
    /// `key`: where the table is (`sinks.NAME`).
    pub fn new(key: String, entries: toml::Table) -> TableReader {
        TableReader {
            key,
            entries,
            valid: Vec::new(),
        }
    }

    /// Where the table is (`sinks.NAME`).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Takes the string `kind`, or `default` when the table has none.
    pub fn take_kind(&mut self, default: &str) -> Result<String, ConfigError> {
        self.valid.push("kind");
        match self.entries.remove("kind") {
            None => Ok(default.to_string()),
            Some(toml::Value::String(kind)) => Ok(kind),
            Some(other) => Err(invalid(
                &format!("{}.kind", self.key),
                format!("a string, not {}", other.type_str()),
            )),
        }
    }

    /// Takes the keys `T` has and reads them into it; a bad value is an error naming its key.
    pub fn take<T: DeserializeOwned>(&mut self) -> Result<T, ConfigError> {
        let keys = keys_of::<T>();
        self.valid.extend(keys);
        self.take_quietly(keys)
    }

    /// [`TableReader::take`] for keys a table accepts and ignores: they are read (so a value of the
    /// wrong type is still refused) but not offered in the list of valid keys.
    pub fn take_unused<T: DeserializeOwned>(&mut self) -> Result<T, ConfigError> {
        self.take_quietly(keys_of::<T>())
    }

    fn take_quietly<T: DeserializeOwned>(&mut self, keys: &[&str]) -> Result<T, ConfigError> {
        let part: toml::Table = keys
            .iter()
            .filter_map(|key| self.entries.remove_entry(*key))
            .collect();
        serde_path_to_error::deserialize(toml::Value::Table(part)).map_err(|error| {
            let path = error.path().to_string();
            let key = match path.as_str() {
                "." => self.key.clone(),
                path => format!("{}.{path}", self.key),
            };
            invalid(&key, error.into_inner().to_string())
        })
    }

    /// Refuses a key no part took. `what`: the table's kind, as in "a webhook sink".
    pub fn finish(self, what: &str) -> Result<(), ConfigError> {
        match self.entries.keys().next() {
            None => Ok(()),
            Some(unknown) => Err(invalid(
                &format!("{}.{unknown}", self.key),
                format!(
                    "{what} has no such key; its keys are {}",
                    self.valid.join(", ")
                ),
            )),
        }
    }
}
/// "a" or "an" before `word`, as it is spoken in a message about a table (the kinds of sinks and sources: "an amqp sink").
pub fn article(word: &str) -> &'static str {
    match word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        true => "an",
        false => "a",
    }
}
