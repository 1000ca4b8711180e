package migrations

import (
	"context"
	"database/sql"
	"io/fs"
	"path"
	"testing/fstest"

	"github.com/pressly/goose/v3"
)

// LegacyFiles is what an older idemq applied with goose's defaults: the files of both
// sets' legacy versions, in one directory.
func LegacyFiles() fs.FS {
	out := fstest.MapFS{}
	for _, s := range []*set{core, example} {
		for _, lv := range s.legacy {
			names, err := fs.Glob(s.files, "*.sql")
			if err != nil {
				panic(err)
			}
			for _, name := range names {
				if v, err := goose.NumericComponent(path.Base(name)); err == nil && v == lv.version {
					b, err := fs.ReadFile(s.files, name)
					if err != nil {
						panic(err)
					}
					out[name] = &fstest.MapFile{Data: b}
				}
			}
		}
	}
	return out
}

// LegacyVersions are the versions of the core set and of the example set an older idemq
// recorded in goose_db_version.
func LegacyVersions() (coreVersions, exampleVersions []int64) {
	for _, lv := range core.legacy {
		coreVersions = append(coreVersions, lv.version)
	}
	for _, lv := range example.legacy {
		exampleVersions = append(exampleVersions, lv.version)
	}
	return coreVersions, exampleVersions
}

// UpFiles applies the migrations of fsys as a set of their own, recorded in table, with
// Up's refusal of contract steps.
func UpFiles(ctx context.Context, db *sql.DB, fsys fs.FS, table string) ([]*goose.MigrationResult, error) {
	return (&set{name: "test", table: table, files: fsys}).up(ctx, db)
}

// ReadSteps is readSteps.
func ReadSteps(fsys fs.FS) ([]Step, error) { return readSteps(fsys) }

// CoreFS is the embedded core set.
func CoreFS() fs.FS { return core.files }

// TheExampleFS is the embedded example set.
func TheExampleFS() fs.FS { return example.files }
