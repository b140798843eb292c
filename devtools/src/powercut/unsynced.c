/*
 * unsynced.c: an LD_PRELOAD shim that models a power cut for the files under one directory.
 *
 * A power cut loses what the kernel had not made durable: file data written since the file's
 * last fsync/fdatasync, and names (creations, renames, unlinks) made since their directory's
 * last fsync. SIGKILL does not model that (the page cache survives it); this shim does. Built
 * and driven by `cairn::powercut` (see its module docs); only Linux with glibc is supported.
 *
 * For every file under CAIRN_POWERCUT_DIR it keeps an undo log per inode: before each write,
 * pwrite, writev, pwritev, copy_file_range (into the file) or ftruncate (and an open with
 * O_TRUNC) it saves the bytes the call will overwrite or cut off, and the size the file had at its last sync. fsync, fdatasync,
 * syncfs and sync clear the logs they make durable; sync_file_range clears nothing (it starts
 * writeback but neither persists the size nor flushes the device cache). Name changes under
 * the directory (creating opens, mkdir, rename, unlink, rmdir) are logged per parent
 * directory, and an fsync of that directory clears them. An rmdir hands the pending name
 * changes inside the removed directory to its parent: they become durable with the removal
 * itself (a later directory that reuses the inode number must not clear, or replay, them). Files removed or replaced are kept
 * alive by a hard link in CAIRN_POWERCUT_STASH (same file system) until the name change is
 * durable, so that it can be undone.
 *
 * The cut comes before the CAIRN_POWERCUT_AFTER-th intercepted operation on the directory
 * (writes, truncations, syncs, sync_file_range, name changes). It then, holding the shim's lock
 * so that no other thread's operation can slip in:
 *   1. reverts the file data: CAIRN_POWERCUT_FILES=revert restores every unsynced byte and
 *      size (the state as of each file's last sync); =torn reverts a seeded random half of the
 *      unsynced writes (a reverted write that had extended the file leaves zeros, as a
 *      data=writeback file system can), modelling writeback that got some pages out;
 *   2. with CAIRN_POWERCUT_NAMES=vanish, undoes in reverse order every name change whose
 *      directory was not fsynced since (new files and directories vanish, renames and unlinks
 *      come back); with =keep the names stay as they are (a journaling file system that
 *      committed them);
 *   3. writes one line `cairn-powercut: ...` with the figures to stderr and calls exit_group
 *      with status 86 at once: no atexit handler, no destructor, no other thread runs on.
 *
 * The undo logs are per process: a sync made by another process is not seen. Use it on one
 * process that owns the directory (a store does: sled's lock file keeps out any other).
 *
 * The shim never calls an intercepted function itself (it uses raw system calls), and a
 * thread-local flag passes through any call made while the shim is working, so it cannot
 * recurse. One mutex serializes every intercepted operation on the directory, including the
 * real system call, so a sync and the clearing of its log are atomic with respect to the cut.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define EXIT_STATUS 86

/* ---- state ---------------------------------------------------------------------------- */

struct undo {
    off_t off;
    size_t len;        /* bytes the write covered */
    size_t saved_len;  /* of them, bytes that existed before (saved) */
    off_t size_before; /* the file's size just before the write */
    char *saved;
};

struct inode {
    dev_t dev;
    ino_t ino;
    int fd; /* our own O_RDWR descriptor, so undoing needs no path */
    off_t synced_size;
    struct undo *undos;
    size_t count, cap;
};

enum name_kind { NAME_CREATE, NAME_MKDIR, NAME_RENAME, NAME_UNLINK, NAME_RMDIR };

struct name_op {
    enum name_kind kind;
    dev_t dir_dev; /* the directory whose fsync makes it durable */
    ino_t dir_ino;
    char *path;   /* created / unlinked / renamed from */
    char *path2;  /* renamed to */
    char *backup; /* stash link of the unlinked or replaced file, or NULL */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static __thread int busy; /* this thread is inside the shim: pass everything through */

static int enabled;
static char target[4096];
static size_t target_len;
static char stash[4096];
static long long after_ops; /* cut before this operation (1-based); 0: never */
static long long ops;
static int names_vanish;
static int files_torn;
static uint64_t rng_state;
static unsigned long long stash_seq;

static struct inode *inodes;
static size_t inode_count, inode_cap;
static struct name_op *names;
static size_t name_count, name_cap;

/* ---- raw system calls: never through an intercepted symbol ------------------------------ */

static long raw_fstat(int fd, struct stat *st) { return syscall(SYS_fstat, fd, st); }
static long raw_stat(const char *p, struct stat *st) {
    return syscall(SYS_newfstatat, AT_FDCWD, p, st, 0);
}
static long raw_lstat(const char *p, struct stat *st) {
    return syscall(SYS_newfstatat, AT_FDCWD, p, st, AT_SYMLINK_NOFOLLOW);
}
static long raw_open(const char *p, int flags) {
    return syscall(SYS_openat, AT_FDCWD, p, flags | O_CLOEXEC, 0);
}
static long raw_pread(int fd, void *b, size_t n, off_t o) { return syscall(SYS_pread64, fd, b, n, o); }
static long raw_pwrite(int fd, const void *b, size_t n, off_t o) {
    return syscall(SYS_pwrite64, fd, b, n, o);
}
static long raw_write(int fd, const void *b, size_t n) { return syscall(SYS_write, fd, b, n); }

static void say(const char *text) { raw_write(2, text, strlen(text)); }

static void die(const char *why) {
    say("cairn-powercut: fatal: ");
    say(why);
    say("\n");
    syscall(SYS_exit_group, 87);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) die("out of memory");
    return q;
}

static char *xstrdup(const char *s) {
    char *d = strdup(s);
    if (!d) die("out of memory");
    return d;
}

static uint64_t next_random(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void init(void) {
    const char *dir = getenv("CAIRN_POWERCUT_DIR");
    if (!dir || !*dir) return;
    if (dir[0] != '/' || strlen(dir) >= sizeof target) die("CAIRN_POWERCUT_DIR must be absolute");
    strcpy(target, dir);
    target_len = strlen(target);
    while (target_len > 1 && target[target_len - 1] == '/') target[--target_len] = 0;
    const char *s = getenv("CAIRN_POWERCUT_STASH");
    if (!s || s[0] != '/' || strlen(s) >= sizeof stash) die("CAIRN_POWERCUT_STASH must be absolute");
    strcpy(stash, s);
    const char *a = getenv("CAIRN_POWERCUT_AFTER");
    after_ops = a ? atoll(a) : 0;
    const char *n = getenv("CAIRN_POWERCUT_NAMES");
    names_vanish = n && strcmp(n, "vanish") == 0;
    const char *f = getenv("CAIRN_POWERCUT_FILES");
    files_torn = f && strcmp(f, "torn") == 0;
    const char *seed = getenv("CAIRN_POWERCUT_SEED");
    rng_state = seed ? strtoull(seed, NULL, 10) : 0;
    enabled = 1;
}

/* ---- paths -------------------------------------------------------------------------------- */

static int under_target(const char *path) {
    return strncmp(path, target, target_len) == 0 &&
           (path[target_len] == '/' || path[target_len] == 0);
}

/* The absolute path of `path` relative to `dirfd` (no normalisation: callers pass clean paths). */
static int resolve(int dirfd, const char *path, char *out, size_t size) {
    if (!path) return -1;
    if (path[0] == '/') {
        if (strlen(path) >= size) return -1;
        strcpy(out, path);
        return 0;
    }
    char base[4096];
    long n;
    if (dirfd == AT_FDCWD) {
        n = syscall(SYS_getcwd, base, sizeof base);
        if (n <= 0) return -1;
        n = (long)strlen(base);
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        n = syscall(SYS_readlinkat, AT_FDCWD, link, base, sizeof base - 1);
        if (n <= 0) return -1;
        base[n] = 0;
    }
    if ((size_t)snprintf(out, size, "%s/%s", base, path) >= size) return -1;
    return 0;
}

static int fd_path(int fd, char *out, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    long n = syscall(SYS_readlinkat, AT_FDCWD, link, out, size - 1);
    if (n <= 0) return -1;
    out[n] = 0;
    return 0;
}

static int fd_under_target(int fd) {
    char path[4096];
    return fd_path(fd, path, sizeof path) == 0 && under_target(path);
}

static void parent_of(const char *path, char *out, size_t size) {
    snprintf(out, size, "%s", path);
    char *slash = strrchr(out, '/');
    if (slash == out) out[1] = 0;
    else if (slash) *slash = 0;
}

/* ---- the undo logs ------------------------------------------------------------------------ */

static struct inode *inode_of(int fd, const struct stat *st) {
    for (size_t i = 0; i < inode_count; i++)
        if (inodes[i].dev == st->st_dev && inodes[i].ino == st->st_ino) return &inodes[i];
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    long own = raw_open(link, O_RDWR);
    if (own < 0) die("cannot reopen a written file for its undo log");
    if (inode_count == inode_cap) {
        inode_cap = inode_cap ? 2 * inode_cap : 16;
        inodes = xrealloc(inodes, inode_cap * sizeof *inodes);
    }
    struct inode *node = &inodes[inode_count++];
    memset(node, 0, sizeof *node);
    node->dev = st->st_dev;
    node->ino = st->st_ino;
    node->fd = (int)own;
    node->synced_size = st->st_size;
    return node;
}

/* Saves what writing `len` bytes at `off` of `fd` (a regular file) will overwrite. */
static void save_range(int fd, off_t off, size_t len) {
    struct stat st;
    if (raw_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return;
    struct inode *node = inode_of(fd, &st);
    struct undo u = {.off = off, .len = len, .size_before = st.st_size};
    if (off < st.st_size) {
        u.saved_len = (size_t)(st.st_size - off) < len ? (size_t)(st.st_size - off) : len;
        u.saved = xrealloc(NULL, u.saved_len ? u.saved_len : 1);
        size_t done = 0;
        while (done < u.saved_len) {
            long n = raw_pread(node->fd, u.saved + done, u.saved_len - done, off + (off_t)done);
            if (n <= 0) die("cannot read the bytes a write overwrites");
            done += (size_t)n;
        }
    }
    if (node->count == node->cap) {
        node->cap = node->cap ? 2 * node->cap : 16;
        node->undos = xrealloc(node->undos, node->cap * sizeof *node->undos);
    }
    node->undos[node->count++] = u;
}

static void clear_inode(struct inode *node) {
    for (size_t i = 0; i < node->count; i++) free(node->undos[i].saved);
    free(node->undos);
    syscall(SYS_close, node->fd);
    *node = inodes[--inode_count];
}

static void clear_name(size_t i) {
    if (names[i].backup) syscall(SYS_unlinkat, AT_FDCWD, names[i].backup, 0);
    free(names[i].path);
    free(names[i].path2);
    free(names[i].backup);
    memmove(&names[i], &names[i + 1], (name_count - i - 1) * sizeof *names);
    name_count--;
}

/* An fsync/fdatasync of `fd` succeeded: its data, or the names in it, are durable. */
static void synced(int fd) {
    struct stat st;
    if (raw_fstat(fd, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        for (size_t i = name_count; i-- > 0;)
            if (names[i].dir_dev == st.st_dev && names[i].dir_ino == st.st_ino) clear_name(i);
        return;
    }
    for (size_t i = 0; i < inode_count; i++)
        if (inodes[i].dev == st.st_dev && inodes[i].ino == st.st_ino) {
            clear_inode(&inodes[i]);
            return;
        }
}

static void synced_all(void) {
    while (inode_count) clear_inode(&inodes[inode_count - 1]);
    while (name_count) clear_name(name_count - 1);
}

static void record_name(enum name_kind kind, const char *path, const char *path2, const char *backup) {
    if (!names_vanish) {
        if (backup) syscall(SYS_unlinkat, AT_FDCWD, backup, 0);
        return;
    }
    char dir[4096];
    struct stat st;
    parent_of(kind == NAME_RENAME ? path2 : path, dir, sizeof dir);
    if (raw_stat(dir, &st) != 0) return;
    if (name_count == name_cap) {
        name_cap = name_cap ? 2 * name_cap : 16;
        names = xrealloc(names, name_cap * sizeof *names);
    }
    names[name_count++] = (struct name_op){
        .kind = kind,
        .dir_dev = st.st_dev,
        .dir_ino = st.st_ino,
        .path = xstrdup(path),
        .path2 = path2 ? xstrdup(path2) : NULL,
        .backup = backup ? xstrdup(backup) : NULL,
    };
}

/* A hard link keeping `path` (a regular file) alive in the stash; NULL when it does not exist. */
static char *stash_link(const char *path) {
    struct stat st;
    if (!names_vanish || raw_lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) return NULL;
    static char link[8192];
    snprintf(link, sizeof link, "%s/%d-%llu", stash, getpid(), ++stash_seq);
    if (syscall(SYS_linkat, AT_FDCWD, path, AT_FDCWD, link, 0) != 0)
        die("cannot link a removed file into CAIRN_POWERCUT_STASH (same file system?)");
    return link;
}

/* ---- the cut ------------------------------------------------------------------------------ */

static void remove_tree(const char *path) {
    struct stat st;
    if (raw_lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (d) {
            struct dirent *e;
            char child[4096];
            while ((e = readdir(d))) {
                if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
                snprintf(child, sizeof child, "%s/%s", path, e->d_name);
                remove_tree(child);
            }
            closedir(d);
        }
        syscall(SYS_unlinkat, AT_FDCWD, path, AT_REMOVEDIR);
    } else {
        syscall(SYS_unlinkat, AT_FDCWD, path, 0);
    }
}

static void cut(const char *before) {
    unsigned long long writes = 0, kept = 0, bytes = 0, files = 0, undone = 0;
    for (size_t i = 0; i < inode_count; i++) {
        struct inode *node = &inodes[i];
        int reverted_all = 1;
        if (node->count) files++;
        for (size_t k = node->count; k-- > 0;) {
            struct undo *u = &node->undos[k];
            if (files_torn && (next_random() & 1)) {
                reverted_all = 0;
                kept++;
                continue;
            }
            writes++;
            bytes += u->len;
            if (u->saved_len && raw_pwrite(node->fd, u->saved, u->saved_len, u->off) != (long)u->saved_len)
                die("cannot restore overwritten bytes");
            /* What the write appended never reached the disk: zeros if the size survives. */
            if (u->len > u->saved_len) {
                size_t gap = u->len - u->saved_len;
                char *zeros = calloc(1, gap);
                if (!zeros) die("out of memory");
                raw_pwrite(node->fd, zeros, gap, u->off + (off_t)u->saved_len);
                free(zeros);
            }
        }
        if (reverted_all && syscall(SYS_ftruncate, node->fd, node->synced_size) != 0)
            die("cannot restore a file's size");
    }
    for (size_t i = name_count; i-- > 0;) {
        struct name_op *n = &names[i];
        undone++;
        switch (n->kind) {
        case NAME_CREATE:
        case NAME_MKDIR:
            remove_tree(n->path);
            break;
        case NAME_RENAME:
            syscall(SYS_renameat, AT_FDCWD, n->path2, AT_FDCWD, n->path);
            if (n->backup) syscall(SYS_renameat, AT_FDCWD, n->backup, AT_FDCWD, n->path2);
            break;
        case NAME_UNLINK:
            if (n->backup) syscall(SYS_renameat, AT_FDCWD, n->backup, AT_FDCWD, n->path);
            break;
        case NAME_RMDIR:
            /* Undone before the unlinks inside it (reverse order), so they have a home. */
            syscall(SYS_mkdirat, AT_FDCWD, n->path, 0755);
            break;
        }
    }
    char line[512];
    snprintf(line, sizeof line,
             "cairn-powercut: cut before operation %lld (%s): reverted %llu unsynced write(s), "
             "%llu byte(s), in %llu file(s); kept %llu; undid %llu name change(s); files=%s "
             "names=%s\n",
             ops, before, writes, bytes, files, kept, undone, files_torn ? "torn" : "revert",
             names_vanish ? "vanish" : "keep");
    say(line);
    syscall(SYS_exit_group, EXIT_STATUS);
}

/* Counts an operation on the directory and cuts the power before the chosen one. Locks. */
static void begin(const char *what) {
    pthread_mutex_lock(&lock);
    busy = 1;
    if (after_ops > 0 && ++ops >= after_ops) cut(what);
}

static void end(void) {
    busy = 0;
    pthread_mutex_unlock(&lock);
}

static int active(void) {
    pthread_once(&once, init);
    return enabled && !busy;
}

/* ---- the intercepted calls ---------------------------------------------------------------- */

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

typedef ssize_t (*write_t)(int, const void *, size_t);
typedef ssize_t (*pwrite_t)(int, const void *, size_t, off_t);
typedef ssize_t (*writev_t)(int, const struct iovec *, int);
typedef ssize_t (*pwritev_t)(int, const struct iovec *, int, off_t);
typedef ssize_t (*pwritev2_t)(int, const struct iovec *, int, off_t, int);
typedef int (*ftruncate_t)(int, off_t);
typedef int (*fd_t)(int);
typedef void (*void_t)(void);
typedef int (*sfr_t)(int, off_t, off_t, unsigned int);
typedef int (*openat_t)(int, const char *, int, ...);
typedef ssize_t (*cfr_t)(int, off64_t *, int, off64_t *, size_t, unsigned int);

static size_t iov_total(const struct iovec *iov, int n) {
    size_t t = 0;
    for (int i = 0; i < n; i++) t += iov[i].iov_len;
    return t;
}

/* The offset a write() on `fd` goes to. */
static off_t write_offset(int fd) {
    int flags = (int)syscall(SYS_fcntl, fd, F_GETFL);
    struct stat st;
    if (flags >= 0 && (flags & O_APPEND) && raw_fstat(fd, &st) == 0) return st.st_size;
    return (off_t)syscall(SYS_lseek, fd, 0, SEEK_CUR);
}

ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write, write_t);
    if (!active() || !fd_under_target(fd)) return real_write(fd, buf, n);
    begin("write");
    save_range(fd, write_offset(fd), n);
    ssize_t r = real_write(fd, buf, n);
    end();
    return r;
}

#define PWRITE(name)                                                          \
    ssize_t name(int fd, const void *buf, size_t n, off_t off) {              \
        REAL(name, pwrite_t);                                                 \
        if (!active() || !fd_under_target(fd)) return real_##name(fd, buf, n, off); \
        begin(#name);                                                         \
        save_range(fd, off, n);                                               \
        ssize_t r = real_##name(fd, buf, n, off);                             \
        end();                                                                \
        return r;                                                             \
    }
PWRITE(pwrite)
PWRITE(pwrite64)

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev, writev_t);
    if (!active() || !fd_under_target(fd)) return real_writev(fd, iov, cnt);
    begin("writev");
    save_range(fd, write_offset(fd), iov_total(iov, cnt));
    ssize_t r = real_writev(fd, iov, cnt);
    end();
    return r;
}

#define PWRITEV(name)                                                                  \
    ssize_t name(int fd, const struct iovec *iov, int cnt, off_t off) {                \
        REAL(name, pwritev_t);                                                         \
        if (!active() || !fd_under_target(fd)) return real_##name(fd, iov, cnt, off);  \
        begin(#name);                                                                  \
        save_range(fd, off == -1 ? write_offset(fd) : off, iov_total(iov, cnt));       \
        ssize_t r = real_##name(fd, iov, cnt, off);                                    \
        end();                                                                         \
        return r;                                                                      \
    }
PWRITEV(pwritev)
PWRITEV(pwritev64)

#define PWRITEV2(name)                                                                       \
    ssize_t name(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {           \
        REAL(name, pwritev2_t);                                                              \
        if (!active() || !fd_under_target(fd)) return real_##name(fd, iov, cnt, off, flags); \
        begin(#name);                                                                        \
        save_range(fd, off == -1 ? write_offset(fd) : off, iov_total(iov, cnt));             \
        ssize_t r = real_##name(fd, iov, cnt, off, flags);                                   \
        end();                                                                               \
        return r;                                                                            \
    }
PWRITEV2(pwritev2)
PWRITEV2(pwritev64v2)

/* A copy into a file under the directory writes up to `n` bytes at the destination's offset:
 * what it may overwrite is saved first, as for pwrite. (The store copies its files with it.) */
ssize_t copy_file_range(int fd_in, off64_t *off_in, int fd_out, off64_t *off_out, size_t n,
                        unsigned int flags) {
    REAL(copy_file_range, cfr_t);
    if (!active() || !fd_under_target(fd_out))
        return real_copy_file_range(fd_in, off_in, fd_out, off_out, n, flags);
    begin("copy_file_range");
    save_range(fd_out, off_out ? (off_t)*off_out : write_offset(fd_out), n);
    ssize_t r = real_copy_file_range(fd_in, off_in, fd_out, off_out, n, flags);
    end();
    return r;
}

#define FTRUNCATE(name)                                                              \
    int name(int fd, off_t len) {                                                    \
        REAL(name, ftruncate_t);                                                     \
        if (!active() || !fd_under_target(fd)) return real_##name(fd, len);          \
        begin(#name);                                                                \
        struct stat st;                                                              \
        if (raw_fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {                        \
            if (len < st.st_size) save_range(fd, len, (size_t)(st.st_size - len));   \
            else inode_of(fd, &st); /* growing: the old size is what comes back */   \
        }                                                                            \
        int r = real_##name(fd, len);                                                \
        end();                                                                       \
        return r;                                                                    \
    }
FTRUNCATE(ftruncate)
FTRUNCATE(ftruncate64)

#define SYNC(name)                                                                   \
    int name(int fd) {                                                               \
        REAL(name, fd_t);                                                            \
        if (!active()) return real_##name(fd);                                       \
        /* Directories outside the target (its parents) hold names made under it. */ \
        if (fd_under_target(fd)) {                                                   \
            begin(#name);                                                            \
        } else {                                                                     \
            pthread_mutex_lock(&lock);                                               \
            busy = 1;                                                                \
        }                                                                            \
        int r = real_##name(fd);                                                     \
        if (r == 0) synced(fd);                                                      \
        end();                                                                       \
        return r;                                                                    \
    }
SYNC(fsync)
SYNC(fdatasync)

int syncfs(int fd) {
    REAL(syncfs, fd_t);
    if (!active()) return real_syncfs(fd);
    begin("syncfs");
    int r = real_syncfs(fd);
    if (r == 0) synced_all();
    end();
    return r;
}

void sync(void) {
    REAL(sync, void_t);
    if (!active()) {
        real_sync();
        return;
    }
    begin("sync");
    real_sync();
    synced_all();
    end();
}

/* Counted (a cut can fall right before it) but clears nothing: it makes nothing durable. */
int sync_file_range(int fd, off_t off, off_t n, unsigned int flags) {
    REAL(sync_file_range, sfr_t);
    if (!active() || !fd_under_target(fd)) return real_sync_file_range(fd, off, n, flags);
    begin("sync_file_range");
    int r = real_sync_file_range(fd, off, n, flags);
    end();
    return r;
}

/* open with O_CREAT or O_TRUNC under the target: logs the creation or saves the truncated bytes. */
static int do_open(int dirfd, const char *path, int flags, mode_t mode, const char *what) {
    REAL(openat, openat_t);
    char abs[4096];
    if (!active() || !(flags & (O_CREAT | O_TRUNC)) || resolve(dirfd, path, abs, sizeof abs) != 0 ||
        !under_target(abs))
        return real_openat(dirfd, path, flags, mode);
    begin(what);
    struct stat st;
    int existed = raw_lstat(abs, &st) == 0;
    if (existed && (flags & O_TRUNC) && S_ISREG(st.st_mode) && (flags & O_ACCMODE) != O_RDONLY) {
        long fd = raw_open(abs, O_RDONLY);
        if (fd >= 0) {
            if (st.st_size > 0) save_range((int)fd, 0, (size_t)st.st_size);
            else inode_of((int)fd, &st);
            syscall(SYS_close, fd);
        }
    }
    int r = real_openat(dirfd, path, flags, mode);
    if (r >= 0 && !existed) record_name(NAME_CREATE, abs, NULL, NULL);
    end();
    return r;
}

#define OPEN(name)                                                     \
    int name(const char *path, int flags, ...) {                       \
        mode_t mode = 0;                                               \
        if (flags & (O_CREAT | O_TMPFILE)) {                           \
            va_list ap;                                                \
            va_start(ap, flags);                                       \
            mode = (mode_t)va_arg(ap, int);                            \
            va_end(ap);                                                \
        }                                                              \
        return do_open(AT_FDCWD, path, flags, mode, #name);            \
    }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                                   \
    int name(int dirfd, const char *path, int flags, ...) {            \
        mode_t mode = 0;                                               \
        if (flags & (O_CREAT | O_TMPFILE)) {                           \
            va_list ap;                                                \
            va_start(ap, flags);                                       \
            mode = (mode_t)va_arg(ap, int);                            \
            va_end(ap);                                                \
        }                                                              \
        return do_open(dirfd, path, flags, mode, #name);               \
    }
OPENAT(openat)
OPENAT(openat64)

int creat(const char *path, mode_t mode) { return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, "creat"); }
int creat64(const char *path, mode_t mode) { return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, "creat64"); }

static int do_rename(int olddir, const char *from, int newdir, const char *to, unsigned int flags) {
    char a[4096], b[4096];
    if (!active() || resolve(olddir, from, a, sizeof a) != 0 || resolve(newdir, to, b, sizeof b) != 0 ||
        !(under_target(a) || under_target(b)))
        return (int)syscall(SYS_renameat2, olddir, from, newdir, to, flags);
    begin("rename");
    char *backup = stash_link(b);
    char *kept = backup ? xstrdup(backup) : NULL;
    int r = (int)syscall(SYS_renameat2, olddir, from, newdir, to, flags);
    if (r == 0) record_name(NAME_RENAME, a, b, kept);
    else if (kept) syscall(SYS_unlinkat, AT_FDCWD, kept, 0);
    free(kept);
    end();
    return r;
}

int rename(const char *from, const char *to) { return do_rename(AT_FDCWD, from, AT_FDCWD, to, 0); }
int renameat(int od, const char *from, int nd, const char *to) { return do_rename(od, from, nd, to, 0); }
int renameat2(int od, const char *from, int nd, const char *to, unsigned int flags) {
    return do_rename(od, from, nd, to, flags);
}

static int do_unlink(int dirfd, const char *path, int flags) {
    char abs[4096];
    if (!active() || resolve(dirfd, path, abs, sizeof abs) != 0 || !under_target(abs))
        return (int)syscall(SYS_unlinkat, dirfd, path, flags);
    begin(flags & AT_REMOVEDIR ? "rmdir" : "unlink");
    /* A removed directory is empty; its own removal is logged below, files need a backup. */
    char *backup = (flags & AT_REMOVEDIR) ? NULL : stash_link(abs);
    char *kept = backup ? xstrdup(backup) : NULL;
    struct stat gone;
    int have_gone = (flags & AT_REMOVEDIR) && raw_lstat(abs, &gone) == 0;
    int r = (int)syscall(SYS_unlinkat, dirfd, path, flags);
    if (r == 0 && kept) record_name(NAME_UNLINK, abs, NULL, kept);
    else if (kept) syscall(SYS_unlinkat, AT_FDCWD, kept, 0);
    if (r == 0 && have_gone && names_vanish) {
        /* The unsynced name changes inside the removed directory now live or die with the
           removal itself, which its parent's fsync makes durable: re-key them to the parent
           (left keyed to the dead directory, a new directory that gets its inode number back
           would clear them by accident, or a cut would replay them into it), and log the
           removal so that a cut brings the directory back before them. */
        char parent[4096];
        struct stat pst;
        parent_of(abs, parent, sizeof parent);
        if (raw_stat(parent, &pst) == 0) {
            for (size_t i = 0; i < name_count; i++)
                if (names[i].dir_dev == gone.st_dev && names[i].dir_ino == gone.st_ino) {
                    names[i].dir_dev = pst.st_dev;
                    names[i].dir_ino = pst.st_ino;
                }
            record_name(NAME_RMDIR, abs, NULL, NULL);
        }
    }
    free(kept);
    end();
    return r;
}

int unlink(const char *path) { return do_unlink(AT_FDCWD, path, 0); }
int unlinkat(int dirfd, const char *path, int flags) { return do_unlink(dirfd, path, flags); }
int rmdir(const char *path) { return do_unlink(AT_FDCWD, path, AT_REMOVEDIR); }

static int do_mkdir(int dirfd, const char *path, mode_t mode) {
    char abs[4096];
    if (!active() || resolve(dirfd, path, abs, sizeof abs) != 0 || !under_target(abs))
        return (int)syscall(SYS_mkdirat, dirfd, path, mode);
    begin("mkdir");
    int r = (int)syscall(SYS_mkdirat, dirfd, path, mode);
    if (r == 0) record_name(NAME_MKDIR, abs, NULL, NULL);
    end();
    return r;
}

int mkdir(const char *path, mode_t mode) { return do_mkdir(AT_FDCWD, path, mode); }
int mkdirat(int dirfd, const char *path, mode_t mode) { return do_mkdir(dirfd, path, mode); }
