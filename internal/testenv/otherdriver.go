package testenv

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"testing"
)

// OtherSQLDB is a *sql.DB on a driver of its own (OtherDriver), which opens nothing: it
// stands for a database/sql driver that idemq does not support. It is closed when the
// test ends.
func OtherSQLDB(t testing.TB) *sql.DB {
	db := sql.OpenDB(otherConnector{})
	t.Cleanup(func() { db.Close() })
	return db
}

// OtherDriver is OtherSQLDB's driver; an error naming the driver's type names
// "testenv.OtherDriver".
type OtherDriver struct{}

func (OtherDriver) Open(string) (driver.Conn, error) { return nil, errors.New("not a database") }

type otherConnector struct{}

func (otherConnector) Connect(context.Context) (driver.Conn, error) {
	return nil, errors.New("not a database")
}

func (otherConnector) Driver() driver.Driver { return OtherDriver{} }
