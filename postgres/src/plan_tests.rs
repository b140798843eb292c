//! Tests of the plans PostgreSQL makes for the statements that find queued tasks: by key,
//! never by reading the whole queue, whatever the queue held when the plan was made.

use crate::{append, tasks, PgOptions, PgStore};
use sqlx::{Connection, Executor, PgConnection, Row};

/// The highest `$N` in `sql`: how many parameters its PREPARE takes.
fn parameters(sql: &str) -> usize {
    sql.split('$')
        .skip(1)
        .filter_map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .max()
        .unwrap_or(0)
}

/// The generic plan of `sql` on `conn`: the plan a pooled connection keeps once it has run
/// the statement five times, made without the parameters' values.
async fn generic_plan(conn: &mut PgConnection, name: &str, sql: &str) -> String {
    conn.execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap_or_else(|e| panic!("setting the plan cache mode: {e}"));
    conn.execute(format!("PREPARE {name} AS {sql}").as_str())
        .await
        .unwrap_or_else(|e| panic!("preparing {name}: {e}"));
    let nulls = vec!["NULL"; parameters(sql)].join(", ");
    let rows = sqlx::query(&format!("EXPLAIN EXECUTE {name}({nulls})"))
        .fetch_all(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("explaining {name}: {e}"));
    rows.iter()
        .map(|row| row.try_get::<String, _>(0).expect("a plan line"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The plans are made on a new, empty queue, where reading the whole table is the cheapest
/// plan there is: the old append statement got a sequential scan of `cairn_tasks` for the
/// tasks it completes and the tasks it removes, and a pooled connection kept that plan while
/// the queue grew dead rows, so every append read them all. The statements must reach tasks
/// through an index whatever the table's size.
#[tokio::test]
async fn the_append_and_the_lease_reach_tasks_through_indexes() {
    let url = crate::testing::fresh_database().await;
    let store = PgStore::connect(&url, PgOptions::default())
        .await
        .unwrap_or_else(|e| panic!("connecting: {e}"));
    let mut conn = PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("a raw connection: {e}"));
    for (name, sql) in [("append", append::APPEND), ("lease", tasks::LEASE)] {
        let plan = generic_plan(&mut conn, name, sql).await;
        assert!(
            plan.contains("on cairn_tasks"),
            "{name}: the plan reads the queue:\n{plan}"
        );
        assert!(
            !plan.contains("Seq Scan on cairn_tasks"),
            "{name}: a sequential scan of the queue:\n{plan}"
        );
    }
    store.close().await;
}

#[test]
fn parameters_are_counted() {
    assert_eq!(parameters("SELECT $1, $12 WHERE $3 = 'a$b'"), 12);
    assert_eq!(parameters("SELECT 1"), 0);
}
