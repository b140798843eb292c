//! Database URLs as they may be shown: in errors and logs, never with their password.

/// `url` with its password replaced by `***`, both the one in the user info
/// (`postgres://user:secret@host/db`) and a `password=` query parameter. Works on the text,
/// so that even a URL that does not parse is shown without its secret.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_query(url);
    };
    // The user info ends at the last `@`: a password may hold an unescaped `@`, `/` or `?`.
    // (An `@` later in the URL hides more than the password, never less.)
    match rest.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{}", redact_query(host)),
            None => format!("{scheme}://{user_info}@{}", redact_query(host)),
        },
        None => format!("{scheme}://{}", redact_query(rest)),
    }
}

/// `text` with the value of a `password=` query parameter replaced by `***`.
fn redact_query(text: &str) -> String {
    let Some((base, query)) = text.split_once('?') else {
        return text.to_owned();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
            _ => param.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// `url` naming database `name` instead of its own: the path after the host (which follows
/// the user info's last `@`) is replaced, and the query kept.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    // The path starts at the first `/` after the host, which follows the user info's `@`.
    let host_start = base.find("://").map_or(0, |i| i + 3);
    let host_start = base[host_start..]
        .rfind('@')
        .map_or(host_start, |at| host_start + at + 1);
    let server = match base[host_start..].find('/') {
        Some(slash) => &base[..host_start + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_hidden() {
        let cases = [
            (
                "postgres://cairn:s3cret@db.example:5432/cairn",
                "postgres://cairn:***@db.example:5432/cairn",
            ),
            (
                "postgres://cairn:p@ss@db/cairn?sslmode=disable",
                "postgres://cairn:***@db/cairn?sslmode=disable",
            ),
            (
                "postgres://db/cairn?user=cairn&password=s3cret",
                "postgres://db/cairn?user=cairn&password=***",
            ),
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            (
                "postgres://cairn:a/b?c@db/cairn",
                "postgres://cairn:***@db/cairn",
            ),
            ("not a url", "not a url"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
