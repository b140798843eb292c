//! cairn's test tools, kept out of the facade library: the benchmark harness of `cairn bench`
//! ([`mod@bench`], with a [`scratch_database`] per measurement on PostgreSQL, [`cpu`] times,
//! [`footprint`] for `--footprint`, [`parked`] for `--parked`, and [`goals`] with
//! [`transition`] for `--goals`, and the [`machine`] line above its figures), the chaos test
//! ([`chaos`]: kills, startup kills and power cuts of a `cairn chaos-child` process, then every
//! check of the store), the power-cut shim ([`powercut`]) it and the tests use, and the training
//! of the record codec's compression dictionary ([`dictionary`]).

pub mod bench;
pub mod chaos;
pub mod cpu;
pub mod dictionary;
pub mod fixtures;
pub mod footprint;
pub mod goals;
pub mod machine;
pub mod parked;
pub mod powercut;
pub mod process;
pub mod scratch_database;
pub mod stages;
pub mod transition;
